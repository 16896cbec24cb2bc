"""The house's layering, checked on the source: imports point down.

- only kv_connectors/vllm/ imports vLLM, except kv_connectors/checks.py, which hands a user's
  --kv-transfer-config to vLLM's own KVTransferConfig (`vllm`, `vllm.config`; nothing of our adapter);
- the pure core and engine import neither vLLM nor our adapter, nor torch or a transport engine, nor
  any backend module (kv_connectors/nixl/, kv_connectors/mooncake/);
- transports import nothing above them (no engine, adapter or request state): kv_connectors/transports/
  and every module of a backend folder but its face;
- the faces are exactly the backend packages users name in kv_connector_module_path
  (kv_connectors.nixl / .mooncake): with the adapter, the only modules that import the adapter, and they
  do it lazily (inside their module `__getattr__`), so importing a backend's transport imports no vLLM;
- the registry's engines are backend modules, not faces;
- no import cycle among our modules, counting imports inside functions (a lazy import only hides a
  circle until the function runs) and relative ones; TYPE_CHECKING-only imports excepted. Importing a
  backend module (`nixl.transport`) also counts as importing its face (`nixl`), which Python runs
  first; other packages' `__init__`s are not counted for their submodules (transports/__init__ imports
  transports.base: Python's own order, no circle). The adapter reaches the backends through the
  registry (`create_transport`, by module name), never by import, so a face's lazy import of the
  adapter closes no circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "kv_connectors"
# The core's pure modules at the top of the package; every module of the two wings (consumer/,
# producer/) is pure too, whatever it is called (_pure() adds them from the folders).
PURE_CORE = {
    "errors",
    "config",
    "layout",
    "tp",
    "plan",
    "params",
    "groups",
    "compatinfo",
    "counters",
    "wire",
    "specs",
    "sidechannel",
    "logutil",
    "fence",
    "modelgroups",
    "transports.base",
    "worker",
    "transports",
    "transports.memory",
}
WINGS = ("consumer", "producer")


def _pure(modules: dict[str, Path]) -> set[str]:
    return PURE_CORE | {m for m in modules if _under(m, WINGS)}


FACES = ("nixl", "mooncake")  # the module paths users write in kv_connector_module_path: each backend's package
BACKENDS = FACES  # the backend folders: the face (package __init__) and its transport modules
ABOVE_TRANSPORTS = (
    "consumer",
    "producer",
    "worker",
    "specs",
    "params",
    "vllm",
    "plugin",
    "assembly",
    "snapshot",
    "cli",
    "checks",
    "doctor",
    "proxy",
)


def _is_transport(module: str) -> bool:
    """kv_connectors/transports/ (Protocol, registry, memory, intervals, staging) and the backends'
    modules other than their faces."""
    return _under(module, ("transports",)) or (_under(module, BACKENDS) and module not in FACES)


def _is_above_transports(module: str) -> bool:
    return module in FACES or (_under(module, ABOVE_TRANSPORTS) and not _is_transport(module))


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _package_of(path: Path) -> str:
    """The dotted package a file's relative imports start from ("kv_connectors.proxy" for its modules)."""
    return ".".join(("kv_connectors", *path.parent.relative_to(ROOT).parts))


def _is_our_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:]) if name.startswith("kv_connectors.") else None
    return rel is not None and ((ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file())


def _imports(path: Path, module_level_only: bool, packages_of_submodules: bool = True) -> set[str]:
    """Absolute names imported by the file, relative imports resolved (skipping `if TYPE_CHECKING:` blocks).
    packages_of_submodules=False: `from pkg import mod` names pkg.mod only where every name is a module
    of ours (Python initializes pkg first, but imports nothing of what pkg defines)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import) and (top or not module_level_only):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (top or not module_level_only):
            module = node.module or ""
            if node.level:
                base = _package_of(path).split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            names = {f"{module}.{alias.name}" for alias in node.names}
            submodules_only = all(_is_our_module(n) for n in names)
            # `from . import x` names submodules x, not the package being initialized
            if node.module and (packages_of_submodules or not submodules_only):
                found.add(module)
            found.update(names)
        for child in ast.iter_child_nodes(node):
            nested = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, top and not nested)

    visit(tree, True)
    return found


def _ours(names: set[str], modules: dict[str, Path]) -> set[str]:
    out = set()
    for name in names:
        if name.startswith("kv_connectors."):
            rel = name[len("kv_connectors.") :]
            while rel and rel not in modules:
                rel = rel.rpartition(".")[0]
            if rel:
                out.add(rel)
    return out


def _under(module: str, prefixes: tuple[str, ...] | set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


CHECKS_FROM_VLLM = {"vllm", "vllm.config", "vllm.config.KVTransferConfig"}  # check-config's parse, as vLLM's


def test_only_the_adapter_imports_vllm():
    offenders = {}
    for m, path in _modules().items():
        names = {n for n in _imports(path, module_level_only=False) if n == "vllm" or n.startswith("vllm.")}
        if m == "checks":
            names -= CHECKS_FROM_VLLM
        if names and not _under(m, ("vllm",)):
            offenders[m] = sorted(names)
    assert not offenders, f"modules outside kv_connectors/vllm/ import vLLM: {offenders}"


def test_the_core_and_engine_are_pure():
    modules = _modules()
    pure = _pure(modules)
    assert {"consumer.ranks", "producer.writes", "producer.consumers"} <= pure
    for m in pure:
        names = _imports(modules[m], module_level_only=False)
        bad = {n for n in names if n.split(".")[0] in ("vllm", "torch", "nixl", "mooncake")}
        bad |= {
            o
            for o in _ours(names, modules)
            if _under(o, ("vllm", *BACKENDS, "transports.staging")) and not (m == "worker" and _under(o, ("transports.staging",)))
        }
        assert not bad, f"kv_connectors.{m} imports {sorted(bad)}"


def test_only_the_faces_import_the_adapter():
    modules = _modules()
    offenders = [
        m
        for m, path in modules.items()
        if m not in FACES and not _under(m, ("vllm",)) and any(_under(o, ("vllm",)) for o in _ours(_imports(path, False), modules))
    ]
    offenders = [m for m in offenders if m != "plugin"]  # registers through compat, inside register()
    assert not offenders, f"modules other than the adapter and its faces {FACES} import kv_connectors.vllm: {offenders}"


def test_the_faces_are_the_backend_packages_and_import_the_adapter_lazily():
    modules = _modules()
    for face in FACES:
        path = modules[face]
        assert path.name == "__init__.py", f"kv_connectors.{face} is not a backend folder's package"
        eager = _imports(path, module_level_only=True)
        assert not {n for n in eager if n == "vllm" or n.startswith(("vllm.", "kv_connectors."))}, (
            f"kv_connectors.{face} imports {sorted(eager)} at module level: its connector must resolve lazily"
        )
        ours = _ours(_imports(path, module_level_only=False), modules)
        assert ours == {"vllm.connector"}, f"kv_connectors.{face} imports {sorted(ours)}"


def test_a_backends_transport_imports_no_vllm_and_its_face_resolves_the_connector():
    """What the registry does (import the transport module: no vLLM), then what vLLM does with
    kv_connector_module_path (import_module, then getattr), in one fresh process."""
    import subprocess
    import sys

    from kv_connectors.transports import _ENGINES

    faces = {}
    for kind, (module, cls) in _ENGINES.items():
        face = module.rpartition(".")[0]
        assert face.removeprefix("kv_connectors.") in FACES and module.endswith(".transport"), (kind, module)
        faces[face] = (module, cls)
    code = (
        "import importlib, sys\n"
        f"for face, (module, cls) in {faces!r}.items():\n"
        "    assert hasattr(importlib.import_module(module), cls), module\n"
        "    assert 'vllm' not in sys.modules, module + ' imported vLLM'\n"
        "    m = importlib.import_module(face)\n"
        "    assert 'vllm' not in sys.modules, face + ' imported vLLM eagerly'\n"
        "    assert len(m.__all__) == 1 and m.__all__[0] in dir(m), (face, dir(m))\n"
        "from kv_connectors.vllm import connector as adapter\n"
        "for face in " + repr(list(faces)) + ":\n"
        "    name = importlib.import_module(face).__all__[0]\n"
        "    assert getattr(importlib.import_module(face), name) is getattr(adapter, name), face\n"
        "    print(name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["NixlConnector", "MooncakeConnector"]


def test_the_proxy_is_standalone():
    """The proxy speaks vLLM's HTTP API only: it imports nothing else of ours (and no vLLM)."""
    modules = _modules()
    for m, path in modules.items():
        if _under(m, ("proxy",)):
            names = _imports(path, module_level_only=False)
            ours = {o for o in _ours(names, modules) if not _under(o, ("proxy",))}
            assert not ours and not any(n.split(".")[0] == "vllm" for n in names), f"kv_connectors.{m} imports {ours}"


def test_transports_import_nothing_above_them():
    modules = _modules()
    assert {m for m in modules if _is_transport(m) and _under(m, BACKENDS)}, "no backend modules found"
    for m, path in modules.items():
        if not _is_transport(m):
            continue
        names = _imports(path, module_level_only=False, packages_of_submodules=False)
        above = {o for o in _ours(names, modules) if _is_above_transports(o)}
        assert not above, f"transport module kv_connectors.{m} imports {sorted(above)} (above it)"


def test_no_import_cycle():
    """Lazy (function-level) imports count: cli -> doctor -> cli inside functions was a circle too.
    A backend module's importer also depends on the backend's face, which Python initializes first."""
    modules = _modules()
    graph = {m: _ours(_imports(p, module_level_only=False), modules) for m, p in modules.items()}
    for m, deps in graph.items():
        deps |= {face for face in FACES for d in deps if _under(d, (face,))}
        deps.discard(m)
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for dep in graph.get(m, ()):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep, stack + [dep])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_the_wheel_ships_the_package_only_and_imports_what_it_declares():
    """The wheel holds kv_connectors alone (test and benchmark support stay in the checkout), and its
    modules import only the standard library, the declared dependencies and the optional engines."""
    import sys

    import tomllib
    from setuptools import find_packages

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = set(find_packages(str(ROOT.parent), include=include))
    assert shipped and all(p == "kv_connectors" or p.startswith("kv_connectors.") for p in shipped), shipped
    assert {"kvc_testing", "benchmarks", "tests"}.isdisjoint(shipped)
    declared = {"msgspec", "zmq", "numpy"}  # [project] dependencies (pyzmq imports as zmq)
    optional = {"torch", "vllm", "nixl", "mooncake", "ray"}  # the extras (ray: ray-serve), and vLLM's own torch
    proxy_extra = {"fastapi", "starlette", "uvicorn", "httpx", "prometheus_client", "anyio"}  # [proxy] (starlette: fastapi)
    for m, path in _modules().items():
        tops = {n.split(".")[0] for n in _imports(path, module_level_only=False)}
        allowed = declared | optional | (proxy_extra if _under(m, ("proxy",)) else set())
        foreign = tops - set(sys.stdlib_module_names) - allowed - {"kv_connectors"}
        assert not foreign, f"kv_connectors.{m} imports {sorted(foreign)}, which the wheel does not declare"


def test_no_test_module_imports_another_and_support_imports_no_test():
    """A test file is read alone: what two test files share lives in a support module (a conftest.py,
    a helper module of the suite beside its tests, kvc_testing/), and kvc_testing/ and benchmarks/ import
    nothing of tests/. Every folder under tests/ is read (tests/unit/core/, engine/, ...), and a name
    imported from a tests package counts as a module (`from tests.unit.proxy import test_proxy`)."""
    checkout = ROOT.parent
    for path in sorted([*checkout.glob("tests/**/*.py"), *checkout.glob("kvc_testing/*.py"), *checkout.glob("benchmarks/**/*.py")]):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                if node.module.split(".")[0] == "tests":
                    names.update(f"{node.module}.{alias.name}" for alias in node.names)
        where = path.relative_to(checkout)
        if where.parts[0] == "tests":
            tests = [n for n in names if n.split(".")[-1].startswith("test_")]
            assert not tests, f"{where} imports the test module(s) {tests}"
        else:
            assert not [n for n in names if n.split(".")[0] == "tests"], f"{where} imports from tests/"


def test_the_two_wings_stand_on_one_floor():
    """D's wing (consumer/) and P's (producer/) import nothing of each other: what both speak (a
    claim's result, the addresses) lives on the floor below them (wire, specs)."""
    modules = _modules()
    for m, path in modules.items():
        for wing, other in (("consumer", "producer"), ("producer", "consumer")):
            if _under(m, (wing,)):
                crossing = {o for o in _ours(_imports(path, module_level_only=False), modules) if _under(o, (other,))}
                assert not crossing, f"kv_connectors.{m} imports {sorted(crossing)}"
