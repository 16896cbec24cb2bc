"""The benchmarks' house (benchmarks/__init__.py): one family a sub-package; a script (`bench_*`) is
imported by no other module, so what two scripts share lives in a helper module of their family; a
module at the top of benchmarks/ is one that several families use."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmarks"


def _imports(path: Path) -> set[str]:
    """The modules `path` imports, lazy imports included (`from benchmarks.gpu import servers`: both)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_no_benchmark_module_imports_a_script() -> None:
    modules = sorted(BENCH.rglob("*.py"))
    scripts = {_module(p) for p in modules if p.name.startswith("bench_")}
    assert len(scripts) >= 9, scripts
    for path in modules:
        borrowed = sorted(_imports(path) & scripts)
        assert not borrowed, f"{path.relative_to(ROOT)} imports the script(s) {borrowed}: move what they share to a helper module"


def test_every_script_is_in_a_family_and_the_top_holds_only_what_families_share() -> None:
    families = sorted(p.parent for p in BENCH.glob("*/__init__.py"))
    assert {f.name for f in families} >= {"transport", "e2e", "faults", "router", "gpu"}
    assert not list(BENCH.glob("bench_*.py")), "a script belongs to its family's sub-package"
    users: dict[str, set[str]] = {}
    for family in families:
        for path in family.rglob("*.py"):
            for name in _imports(path):
                users.setdefault(name, set()).add(family.name)
    for path in BENCH.glob("*.py"):
        if path.name != "__init__.py":
            assert len(users.get(_module(path), set())) >= 2, f"{path.name} serves one family or none: move it into that family"
