"""bench_transport --cpus: each run confined to the first N CPUs (every thread of this process, and
the processes and threads it starts), the CPUs given back after, and the speed-up reported against
the fewest CPUs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from typing import Any

import pytest

from benchmarks.transport import bench_transport, cpus


def test_counts_are_sorted_distinct_and_within_the_cpus_allowed() -> None:
    assert cpus.parse_counts("2, 1,2", available=2) == [1, 2]
    for bad in ("0", "3", "", "one"):
        with pytest.raises(SystemExit, match="--cpus"):
            cpus.parse_counts(bad, available=2)


def _affinity_of_a_new_thread() -> set[int]:
    seen: list[set[int]] = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    t.start()
    t.join()
    return seen[0]


def test_confined_covers_this_process_its_new_threads_and_children_and_gives_the_cpus_back() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    one = allowed[-1:]  # on a host of two CPUs or more, fewer than this process has
    waiting = threading.Event()
    old_thread_cpus: list[set[int]] = []

    def older_thread() -> None:  # started before: it is confined too (an engine's threads may exist already)
        waiting.wait(10)
        old_thread_cpus.append(os.sched_getaffinity(0))

    t = threading.Thread(target=older_thread)
    t.start()
    try:
        with cpus.confined(one):
            assert os.sched_getaffinity(0) == set(one)
            assert _affinity_of_a_new_thread() == set(one)
            child = subprocess.run(
                [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            )
            assert child.stdout.strip() == str(one)
            waiting.set()
            t.join(10)
        assert old_thread_cpus == [set(one)]
    finally:
        waiting.set()
        t.join(10)
    assert os.sched_getaffinity(0) == set(allowed)
    assert _affinity_of_a_new_thread() == set(allowed)


def test_each_count_runs_confined_and_the_speedup_is_against_the_fewest() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    counts = list(range(1, len(allowed) + 1))
    seen: list[int] = []

    def run(args: argparse.Namespace) -> dict[str, Any]:
        n = len(os.sched_getaffinity(0))
        seen.append(n)
        return {"gbps": 2.0 * n, "ratio": 0.1 * n, "tcp_gbps": 3.0, "ratio_tcp": round(2.0 * n / 3.0, 3)}

    results = cpus.run_counts(argparse.Namespace(cpus=",".join(map(str, counts))), run)
    assert seen == counts and [r["cpus"] for r in results] == counts
    rows = cpus.scaling(results)["scaling"]
    assert [row["speedup"] for row in rows] == [float(n) for n in counts]
    assert all(row["tcp_gbps"] == 3.0 and "cma_gbps" not in row for row in rows)
    assert os.sched_getaffinity(0) == set(allowed)


@pytest.mark.parametrize("other", [["--sweep"], ["--baseline", "HEAD"], ["--compare-homogeneous"]])
def test_cpus_times_one_configuration(other: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_transport.main(["--cpus", "1", *other])
    assert "--cpus times one configuration" in capsys.readouterr().err
