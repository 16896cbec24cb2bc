"""Faults injected into a fleet under load, each when a share of the requests has been answered: a fuzz of
one P's and one D's side channels, a P frozen (SIGSTOP) for a while then resumed, a D killed (SIGKILL)
and restarted on the same ports. Used by the load benchmark (benchmarks/faults/bench_load.py)."""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvc_testing.fuzz import fuzz
from kvc_testing.load import Countdown
from kvc_testing.procs import VllmServer

logger = logging.getLogger(__name__)

FREEZE_S = 12.0
FUZZ_FRAMES = 300


class Fleet(Protocol):
    """What the faults act on: two P and two D behind a proxy; the second of each is the one hurt."""

    @property
    def prefill(self) -> list[VllmServer]: ...

    @property
    def decode(self) -> list[VllmServer]: ...

    def restart_decode(self, old: VllmServer) -> VllmServer:
        """A D started on `old`'s ports, ready (the fleet holds it from then on)."""
        ...


@dataclass
class FaultLog:
    """When each fault happened (seconds since the plan was made) and what failed in the faults themselves."""

    t0: float = field(default_factory=time.monotonic)
    events: list[tuple[float, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.events.append((round(time.monotonic() - self.t0, 1), what))
        logger.info("fault: %s", what)


def plan(fleet: Fleet, requests: int, freeze_s: float = FREEZE_S, seed: int = 7) -> tuple[Countdown, FaultLog]:
    """The faults of a load run of `requests` requests: fuzz at 5% answered, P2 frozen at 15% for
    `freeze_s`, D2 killed at 35% and started again at once (it serves again once it is ready)."""
    log = FaultLog()

    def guarded(name: str, action: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                action()
            except Exception as e:  # noqa: BLE001 - reported by the caller, never lost in a thread
                log.problems.append(f"{name}: {e!r}")

        return run

    def fuzz_side_channels() -> None:
        rng = random.Random(seed)
        for server in (fleet.prefill[0], fleet.decode[0]):
            counts = fuzz(server.side_channel_port, rng, FUZZ_FRAMES)
            log.note(f"fuzzed {server.name}'s side channel: {counts}")

    def freeze_p() -> None:
        p = fleet.prefill[1]
        assert p.pgid is not None
        os.killpg(p.pgid, signal.SIGSTOP)
        log.note(f"froze {p.name}")
        try:
            time.sleep(freeze_s)
        finally:
            os.killpg(p.pgid, signal.SIGCONT)
            log.note(f"resumed {p.name}")

    def kill_and_restart_d() -> None:
        d = fleet.decode[1]
        assert d.pgid is not None
        os.killpg(d.pgid, signal.SIGKILL)
        log.note(f"killed {d.name}")
        d.stop()
        fleet.restart_decode(d)
        log.note(f"restarted {d.name}, ready")

    actions = {
        max(1, requests * 5 // 100): guarded("fuzz", fuzz_side_channels),
        max(2, requests * 15 // 100): guarded("freeze", freeze_p),
        max(3, requests * 35 // 100): guarded("kill-restart", kill_and_restart_d),
    }
    return Countdown(actions), log
