"""The documentation against the code: links resolve, every flag a command block shows exists in that
command's real --help, every --kv-transfer-config shown would start, every config key and metric is
documented, the README stays short and quotes its figures from docs/benchmarks.md."""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from kv_connectors import checks, cli
from kv_connectors.config import VALID_KEYS
from kv_connectors.counters import COUNTERS, Kind, Phase
from kv_connectors.proxy import flags as proxy_flags

ROOT = Path(__file__).resolve().parents[3]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)
FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())  # underscores stay, as in GitHub's anchors
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_the_docs_exist() -> None:
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    wanted = {"configuration.md", "proxy.md", "cli.md", "deployment.md", "observability.md", "troubleshooting.md"}
    assert wanted | {"compatibility.md", "benchmarks.md", "history.md", "design.md"} <= names
    assert (ROOT / "LICENSE").is_file() and (ROOT / "CONTRIBUTING.md").is_file() and (ROOT / "CHANGELOG.md").is_file()


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_relative_link_resolves(doc: Path) -> None:
    text = doc.read_text()
    assert "shared/" not in text and "PLATFORM.md" not in text, f"{_rel(doc)} cites files outside the project"
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{_rel(doc)}: link to {target} (no such file)"
        if anchor:
            assert anchor in _anchors(path), f"{_rel(doc)}: link to {target} (no such heading in {path.name})"


# Commands ---------------------------------------------------------------------------------------
def _commands(doc: Path) -> Iterator[list[str]]:
    """Each command of each shell block (continuations joined, `&&`, `;` and `|` split), as tokens."""
    for lang, body in FENCE.findall(doc.read_text()):
        if lang not in ("", "sh", "bash", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" # ", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            for part in re.split(r"\s(?:&&|;|\|)\s", line):
                tokens = shlex.split(part)
                while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):  # VAR=value before a command
                    tokens.pop(0)
                if tokens:
                    yield tokens


def _help_of_module(module: str) -> str:
    """`python -m MODULE --help`, run in this process (the imports are shared with other tests)."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            runpy.run_module(module, run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


@cache
def _options(command: tuple[str, ...]) -> frozenset[str]:
    """The option strings the real command accepts."""
    if command[0] == "kv-connectors":
        parser = cli.build_parser()
        subs = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
        chosen = subs.choices[command[1]] if len(command) > 1 else parser  # type: ignore[index]
        return frozenset(chosen._option_string_actions) | frozenset(parser._option_string_actions)
    if command[0] == "kv-connectors-proxy":
        return frozenset(proxy_flags.build_parser()._option_string_actions)
    return frozenset(FLAG.findall(_help_of_module(command[0])))


def _ours(tokens: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    """(the command, its arguments) for our commands; None for anyone else's (vllm, curl, pip)."""
    if tokens[0].endswith("python") or tokens[0].endswith("python3"):
        if tokens[1:2] == ["-m"] and len(tokens) > 2:
            module, args = tokens[2], tokens[3:]
            if module == "kv_connectors":
                return _ours(["kv-connectors", *args])
            if module == "kv_connectors.proxy":
                return ("kv-connectors-proxy",), args
            if module.startswith("benchmarks."):
                return (module,), args
        if tokens[1:2] == ["examples/proxy.py"]:
            return ("kv-connectors-proxy",), tokens[2:]
        return None
    if tokens[0] == "kv-connectors" and len(tokens) > 1 and not tokens[1].startswith("-"):
        return ("kv-connectors", tokens[1]), tokens[2:]
    if tokens[0] in ("kv-connectors", "kv-connectors-proxy"):
        return (tokens[0],), tokens[1:]
    return None


def _all_commands() -> list[tuple[str, list[str]]]:
    return [(_rel(doc), tokens) for doc in DOCS for tokens in _commands(doc)]


def test_every_flag_in_a_command_block_exists() -> None:
    checked = 0
    for where, tokens in _all_commands():
        ours = _ours(tokens)
        if ours is None:
            continue
        command, args = ours
        known = _options(command)
        for arg in args:
            if FLAG.fullmatch(arg.split("=", 1)[0]) and not re.fullmatch(r"-\d.*", arg):
                assert arg.split("=", 1)[0] in known, f"{where}: `{' '.join(command)} {arg}` is not in its --help"
        checked += 1
    assert checked >= 15, checked  # the blocks were found at all


def test_every_benchmark_the_makefile_runs_exists_with_its_flags() -> None:
    """The Makefile's `$(VPY) -m benchmarks.X ...` recipe lines, as the docs' command blocks are checked."""
    checked = 0
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^\t\$\(VPY\) -m (benchmarks\.[\w.]+)(.*)$", line)
        if m is None:
            continue
        module, args = m.group(1), shlex.split(re.sub(r"\$\(\w+\)", "", m.group(2)))
        known = _options((module,))
        for arg in args:
            if FLAG.fullmatch(arg.split("=", 1)[0]):
                assert arg.split("=", 1)[0] in known, f"Makefile: `{module} {arg}` is not in its --help"
        checked += 1
    assert checked >= 8, checked


def _transfer_configs() -> Iterator[tuple[str, str]]:
    for where, tokens in _all_commands():
        for flag, value in zip(tokens, tokens[1:]):
            if flag in ("--kv-transfer-config", "--config", "check-config"):
                yield where, value


def test_every_kv_transfer_config_shown_would_start() -> None:
    shown = list(_transfer_configs())
    assert len(shown) >= 5, shown
    for where, text in shown:
        checks.check_transfer_config(json.loads(text))  # vLLM's KVTransferConfig, then ours: raises if not
        assert where


# What the docs must cover -----------------------------------------------------------------------
def test_every_config_key_is_documented_with_its_default() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_]+)` \| ([^|]+) \|", text, re.M)}
    missing = [k for k in VALID_KEYS if k not in rows]
    assert not missing, f"docs/configuration.md has no row for {missing}"


def test_every_metric_is_documented() -> None:
    text = (ROOT / "docs" / "observability.md").read_text()
    names = [f"kvc:{c.name}_total" if c.kind is Kind.COUNTER else f"kvc:{c.name}" for c in COUNTERS if c.metric]
    names += ["kvc:transfer_seconds", *(f"kvc:{p.value}_seconds" for p in Phase)]
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"docs/observability.md does not list {missing}"


# The README -------------------------------------------------------------------------------------
README = ROOT / "README.md"


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200 and len(text.encode()) <= 15_000, (len(text.splitlines()), len(text.encode()))
    blocks = [body for _, body in FENCE.findall(text)]
    assert any("make demo" in b and "make test" in b for b in blocks), "make demo / make test: one block, prominent"
    for word in ("previous checkout", "before the fix", "now fixed", "the old "):
        assert word not in text, f"the README tells history ({word!r}): docs/history.md"


def _performance_bullets() -> list[str]:
    section = README.read_text().split("## Performance", 1)[1].split("\n## ", 1)[0]
    return [line[2:] for line in section.splitlines() if line.startswith("- ")]


def test_the_readme_figures_are_quoted_from_the_benchmarks_page() -> None:
    """One source of figures: each README figure is a 'Current figures' row of docs/benchmarks.md, with
    the same numbers, date, commit and command."""
    bullets = _performance_bullets()
    assert 1 <= len(bullets) <= 3, bullets
    page = (ROOT / "docs" / "benchmarks.md").read_text().split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in page.splitlines() if line.startswith("| ") and "`python -m benchmarks." in line]
    for bullet in bullets:
        command = re.search(r"`(python -m benchmarks\.[^`]+)`", bullet)
        dated = re.search(r"\((\d{4}-\d\d-\d\d), main ([0-9a-f]{7})", bullet)
        assert command and dated, f"a README figure needs its date, commit and command: {bullet}"
        row = next((r for r in rows if f"`{command.group(1)}`" in r), None)
        assert row is not None, f"no docs/benchmarks.md row runs `{command.group(1)}`"
        assert dated.group(1) in row and dated.group(2) in row, (bullet, row)
        figures = re.findall(r"\b\d+\.\d+\b", bullet[: dated.start()])
        assert figures and all(f in row for f in figures), (figures, row)
        assert "of the built-in" in bullet  # the baseline: the tuned built-in, named above the list


# Facts the docs state ---------------------------------------------------------------------------
# The pages that say what the code does now (the changelog and the history say what it did).
CURRENT = sorted(p for p in {*DOCS, ROOT / "ARCHITECTURE.md"} if p.name not in ("CHANGELOG.md", "history.md"))
PATH_NAMED = re.compile(r"(?<![\w/.-])((?:kv_connectors|kvc_testing|benchmarks|tests|examples)/[\w/.-]*\.py)\b")
MODULE_NAMED = re.compile(r"`(kv_connectors(?:\.\w+)+)`")
# Tensor-parallel rank r listens at side_channel_port + r only in the "rank" layout (config.PortLayout;
# by default rank 0 names the others' ports): such a statement names that layout, or is about
# data-parallel engines (port + d, the proxy's PORT + rank).
PORT_PLUS_RANK = re.compile(r"(?:side_channel_port|remote_port|PORT)`?\s*\+\s*(?:r|rank)\b")
LAYOUT_NAMED = ("side_channel_ports", "PortLayout", "data-parallel", "data parallel")


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks; a table's rows each their own."""
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        rows = block.splitlines()
        out += rows if rows and all(r.lstrip().startswith("|") for r in rows) else [block]
    return out


def port_plus_rank_without_its_layout(text: str) -> list[str]:
    return [p.strip()[:160] for p in _paragraphs(text) if PORT_PLUS_RANK.search(p) and not any(w in p for w in LAYOUT_NAMED)]


def test_every_module_path_the_docs_name_exists() -> None:
    missing = [(_rel(doc), m) for doc in CURRENT for m in PATH_NAMED.findall(doc.read_text()) if not (ROOT / m).exists()]
    assert not missing, missing
    for doc in CURRENT:
        for name in MODULE_NAMED.findall(doc.read_text()):
            assert _names_something(name), f"{_rel(doc)}: `{name}` names no module, nor a name defined in one"
    assert _names_something("kv_connectors.config.PortLayout") and _names_something("kv_connectors.nixl")
    assert not _names_something("kv_connectors.config.PortLayouts") and not _names_something("kv_connectors.nixl_old")


def _names_something(dotted: str) -> bool:
    """A module of the package, or a top-level name (def, class, assignment) of one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT / Path(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if source.exists():
            rest = parts[i:]
            if not rest:
                return True
            pattern = rf"^(?:(?:async )?def|class) {rest[0]}\b|^{rest[0]}\s*[:=]|^from \S+ import .*\b{rest[0]}\b"
            return len(rest) <= 2 and re.search(pattern, source.read_text(), re.M) is not None
    return False


def test_a_port_per_tensor_parallel_rank_is_stated_with_the_layout_that_has_it() -> None:
    wrong = {_rel(doc): port_plus_rank_without_its_layout(doc.read_text()) for doc in CURRENT}
    assert not {k: v for k, v in wrong.items() if v}, wrong
    planted = "- Tensor parallelism: every worker rank runs its own engine (side channel at\n  `side_channel_port + rank`)."
    assert port_plus_rank_without_its_layout(planted), "the check lets the old false statement through"
