"""errors.py draws its tree in its docstring: every error class is drawn, under the parent it has."""

from __future__ import annotations

import inspect
import re

from kv_connectors import errors


def test_the_drawn_tree_is_the_class_tree():
    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.KVConnectorError)}
    doc = errors.__doc__ or ""
    drawn: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        m = re.match(r"^(\s*(?:[│ ]{4})*(?:[├└]── )?)(\w+Error)\b", line)
        if not m:
            continue
        depth = len(m.group(1))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        drawn[m.group(2)] = stack[-1][1] if stack else None
        stack.append((depth, m.group(2)))
    assert set(drawn) == set(classes), f"drawn {sorted(drawn)}, defined {sorted(classes)}"
    for name, parent in drawn.items():
        ours = [b.__name__ for b in classes[name].__bases__ if issubclass(b, errors.KVConnectorError)]
        assert ours == ([parent] if parent else []), f"{name} is drawn under {parent}, derives from {ours}"
