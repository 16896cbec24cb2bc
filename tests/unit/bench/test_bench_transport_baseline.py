"""bench_transport --baseline: the command each checkout gets, the alternation and the ratio."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from benchmarks.transport import baseline as tb


def _args(**kw: Any) -> argparse.Namespace:
    base = dict(transport="nixl", mode="pull", order="sequential", size_mib=256, block_kib=16, layers=8, repeat=5, staging="off")
    return argparse.Namespace(**{**base, "baseline": "old", "rounds": 4, **kw})


def test_a_package_checkout_runs_the_module_an_older_one_the_script(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    old = tb.command(tmp_path, _args())
    assert old[1:3] == ["benchmarks/bench_transport.py", "--json"] and old[old.index("--order") + 1] == "sequential"
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    new = tb.command(tmp_path, _args())
    assert new[1:4] == ["-m", "benchmarks.bench_transport", "--json"] and new[new.index("--size-mib") + 1] == "256"


def test_a_checkout_with_benchmark_families_runs_the_family_module(tmp_path: Path) -> None:
    (tmp_path / "benchmarks" / "transport").mkdir(parents=True)
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "transport" / "bench_transport.py").write_text("")
    argv = tb.command(tmp_path, _args())
    assert argv[1:4] == ["-m", "benchmarks.transport.bench_transport", "--json"] and argv[argv.index("--mode") + 1] == "pull"
    # This checkout is one (HERE is the repository's root: its worktrees are added from there).
    assert tb.command(tb.HERE, _args())[1:4] == ["-m", "benchmarks.transport.bench_transport", "--json"]


def test_rounds_alternate_and_the_ratio_is_of_medians(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "kv_connectors").mkdir()
    calls: list[str] = []

    def fake_run(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
        mine = tree == tb.HERE
        calls.append("ours" if mine else "theirs")
        return {"gbps": 6.0 if mine else 4.0, "ratio": 0.6 if mine else 0.4}

    monkeypatch.setattr(tb, "run_in", fake_run)
    result = tb.compare(_args(baseline=str(tmp_path)))
    assert calls == ["theirs", "ours", "ours", "theirs"] * 2
    assert result["ratio_to_baseline"] == 1.5 and result["ratio_to_baseline_of_memcpy_ratios"] == 1.5


def test_a_baseline_that_is_neither_a_checkout_nor_a_commit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no kv_connectors"):
        with tb.checkout(str(tmp_path)):
            pass
    with pytest.raises(SystemExit, match="neither a directory nor a commit"):
        with tb.checkout("no-such-commit-xyz"):
            pass
