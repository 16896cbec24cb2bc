"""The idle soak's arithmetic: the cores each group used over one shared window (kvc_testing.procs
group_cores, which the e2e suite's restart of a busy server uses too), and after which step a server
first went over the limit (the report must name the step, not just that it happened)."""

from __future__ import annotations

from typing import Any

from benchmarks.faults.bench_idle import first_over
from kvc_testing.procs import group_cores


class FakeServer:
    """A server whose group CPU seconds grow by `rate` cores while the fake sleep runs."""

    def __init__(self, rate: float) -> None:
        self.rate, self.cpu = rate, 0.0

    def group_cpu_seconds(self) -> float:
        return self.cpu


def test_group_cores_share_one_window() -> None:
    busy, quiet = FakeServer(1.0), FakeServer(0.02)
    slept: list[float] = []
    now = [100.0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds
        for s in (busy, quiet):
            s.cpu += s.rate * seconds

    cores = [round(c, 3) for c in group_cores([busy, quiet], 0.2, sleep=sleep, clock=lambda: now[0])]  # type: ignore[list-item]
    assert slept == [0.2], "one window for every server"
    assert cores == [1.0, 0.02], cores


def test_first_over_names_the_step() -> None:
    rows: list[dict[str, Any]] = [
        {"round": 0, "step": "start", "p_cores": 0.03, "d_cores": 0.02},
        {"round": 1, "step": "pull-d", "p_cores": 0.04, "d_cores": 0.03},
        {"round": 1, "step": "killed-d", "p_cores": 0.98, "d_cores": 0.03},
        {"round": 1, "step": "push-d", "p_cores": 1.01, "d_cores": 0.6},
    ]
    assert first_over(rows, "p_cores", 0.5) == "1:killed-d"
    assert first_over(rows, "d_cores", 0.5) == "1:push-d"
    assert first_over(rows, "d_cores", 1.0) is None
