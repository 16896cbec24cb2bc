"""bench_transport --baseline: this checkout against another one (a directory, or a git commit checked out
for the run) in the same run, round after round (each checkout's benchmark in a process of its own,
alternating, so a noisy neighbour hurts both alike), with the ratio of their medians.

Only the options both checkouts know are passed on (--transport, --mode, --order, --size-mib,
--block-kib, --layers, --repeat, --staging): an earlier checkout may lack the others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[2]
PASSED_ON = ("transport", "mode", "order", "size_mib", "block_kib", "layers", "repeat", "staging")
ROUND_TIMEOUT_S = 900.0


@contextlib.contextmanager
def checkout(spec: str) -> Iterator[Path]:
    """A directory holding a kv-connectors checkout: `spec` itself, or `spec` (a commit) checked out
    from this repository into a temporary worktree removed afterwards."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "kv_connectors").is_dir():
            raise SystemExit(f"--baseline {spec}: no kv_connectors/ there")
        yield path.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="kvc-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        done = subprocess.run(
            ["git", "-C", str(HERE), "worktree", "add", "--detach", str(tree), spec], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"--baseline {spec}: neither a directory nor a commit here ({done.stderr.strip()})")
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(tree)], capture_output=True)


def command(tree: Path, args: argparse.Namespace) -> list[str]:
    """The checkout's bench_transport (in benchmarks/transport/ since the benchmarks were grouped by
    family, a module of the benchmarks package since 85cd75a, a script before), --json."""
    if (tree / "benchmarks" / "transport" / "bench_transport.py").exists():
        entry = ["-m", "benchmarks.transport.bench_transport"]
    elif (tree / "benchmarks" / "__init__.py").exists():
        entry = ["-m", "benchmarks.bench_transport"]
    else:
        entry = ["benchmarks/bench_transport.py"]
    argv = [sys.executable, *entry, "--json"]
    for name in PASSED_ON:
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv


def run_in(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One benchmark run in `tree` (its own kv_connectors first on the path); its JSON line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(command(tree, args), cwd=tree, env=env, capture_output=True, text=True, timeout=ROUND_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"bench_transport in {tree} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """args.rounds rounds of (baseline, this checkout), alternating which goes first."""
    with checkout(args.baseline) as tree:
        ours: list[dict[str, Any]] = []
        theirs: list[dict[str, Any]] = []
        for i in range(args.rounds):
            order = [(theirs, tree), (ours, HERE)] if i % 2 == 0 else [(ours, HERE), (theirs, tree)]
            for into, where in order:
                into.append(run_in(where, args))
                print(
                    f"round {i + 1}: {'this checkout' if where == HERE else args.baseline}: {into[-1]['gbps']:.2f} GB/s, "
                    f"{into[-1]['ratio']:.3f} of memcpy",
                    flush=True,
                )

    def median(runs: list[dict[str, Any]], key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 3)

    return {
        "benchmark": "transport-baseline",
        "baseline": args.baseline,
        "options": {name: getattr(args, name) for name in PASSED_ON},
        "rounds": args.rounds,
        "gbps": median(ours, "gbps"),
        "baseline_gbps": median(theirs, "gbps"),
        "ratio_memcpy": median(ours, "ratio"),
        "baseline_ratio_memcpy": median(theirs, "ratio"),
        "ratio_to_baseline": round(median(ours, "gbps") / median(theirs, "gbps"), 3),
        "ratio_to_baseline_of_memcpy_ratios": round(median(ours, "ratio") / median(theirs, "ratio"), 3),
    }
