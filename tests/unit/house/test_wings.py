"""The wings' objects keep their own counts: a module of consumer/ or producer/ adds to (+=, -=) an
attribute of another object only where that object is a record of its own module's class (the
receiver's RecvTotals); an object of another room counts its own (P's Sender once bumped its
Writes' failures itself)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "kv_connectors"


def _foreign_counts(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    local_classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    out = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        own = set()  # self.X = LocalClass(...) somewhere in the class
        for node in ast.walk(cls):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
                if node.value.func.id in local_classes:
                    own |= {ast.unparse(t) for t in node.targets}
        for node in ast.walk(cls):
            t = node.target if isinstance(node, ast.AugAssign) else None
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute) and ast.unparse(t.value).startswith("self."):
                if ast.unparse(t.value) not in own:
                    out.append(f"{where}:{node.lineno} {cls.name}: {ast.unparse(t)}")
    return out


def test_no_object_of_a_wing_bumps_another_rooms_counts():
    paths = [path for wing in ("consumer", "producer") for path in sorted((ROOT / wing).glob("*.py"))]
    found = [f for path in paths for f in _foreign_counts(path.read_text(), str(path.relative_to(ROOT.parent)))]
    assert not found, found


def test_the_check_sees_a_foreign_count():
    planted = "class Sender:\n    def f(self):\n        self.writes.failures += 1\n"
    assert _foreign_counts(planted, "sender.py") == ["sender.py:3 Sender: self.writes.failures"]
