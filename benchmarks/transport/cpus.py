"""bench_transport.py --cpus: the same benchmark confined to 1, 2, ... of this host's CPUs, to tell
a transfer held back by the CPUs it gets (its speed grows with them) from one held back by the
engine's path (it does not). Every process of a run is confined alike: this one (D, its engine
threads), P and the raw-TCP baseline's sender, which inherit its CPUs when they start; the baselines
in the same run are timed on the same CPUs."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def parse_counts(text: str, available: int) -> list[int]:
    """--cpus "1,2" as sorted distinct counts, each between 1 and the CPUs this process may use."""
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--cpus needs whole numbers of CPUs, got {text!r}") from None
    if not counts or counts[0] < 1 or counts[-1] > available:
        raise SystemExit(f"--cpus: {text!r}; counts from 1 to the {available} CPUs this process may use")
    return counts


def label(n: int) -> str:
    """'1 CPU', '2 CPUs'."""
    return f"{n} CPU{'s' if n > 1 else ''}"


def _threads() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


@contextlib.contextmanager
def confined(cpus: Sequence[int]) -> Iterator[None]:
    """Every thread of this process on `cpus` (threads and processes started inside inherit them);
    each thread's own CPUs back after."""
    before = {tid: os.sched_getaffinity(tid) for tid in _threads()}
    for tid in before:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)
    try:
        yield
    finally:
        own = before[os.getpid()]
        for tid in _threads():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, before.get(tid, own))


def scaling(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each count's transport and baseline speeds, and the transport's speed-up over the fewest CPUs."""
    first = results[0]["gbps"]
    rows = []
    for r in results:
        row = {"cpus": r["cpus"], "gbps": r["gbps"], "ratio": r["ratio"], "speedup": round(r["gbps"] / first, 3)}
        row.update({k: r[k] for k in ("ratio_tcp", "tcp_gbps", "cma_gbps", "cma_gbps_threads") if k in r})
        rows.append(row)
    return {"scaling": rows}


def run_counts(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]]) -> list[dict[str, Any]]:
    """run(args) once per count in args.cpus, confined to the first that many of this process's CPUs."""
    allowed = sorted(os.sched_getaffinity(0))
    results = []
    for n in parse_counts(args.cpus, len(allowed)):
        with confined(allowed[:n]):
            r = run(args)
        r["cpus"] = n
        results.append(r)
    return results


def report(results: Sequence[dict[str, Any]]) -> None:
    for row in scaling(results)["scaling"]:
        tcp = f", {row['ratio_tcp']:.3f} of raw TCP ({row['tcp_gbps']:.2f} GB/s)" if "ratio_tcp" in row else ""
        kernel = ""
        if "cma_gbps" in row:
            kernel = f", kernel {row['cma_gbps']:.2f} / {row['cma_gbps_threads']:.2f} GB/s (1 thread / one per CPU)"
        speed = f"{row['gbps']:.2f} GB/s, {row['ratio']:.3f} of memcpy{tcp}{kernel}"
        print(f"{label(row['cpus'])}: {speed}; x{row['speedup']:.2f} of {results[0]['cpus']}")
