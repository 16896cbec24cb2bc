"""The transport contract's fixture: a connected pair (P, D) per transport kind, and what each kind may do differently.

D is the test's own transport (kvc_testing.peers.open_local). P is a peer process for the real
engines (one per kind for the module, restarted if a test made it disappear) and an in-process
peer over a `MemoryFabric` for the memory transport. Every kind runs every contract test; where a
kind genuinely differs, `Caps` says so and the test asserts that behaviour instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kv_connectors.plan import TransferPlan, plan_transfer
from kv_connectors.transports.base import Transport, XferState
from kv_connectors.transports.memory import MemoryFabric
from kv_connectors.transports.staging.direct import FragmentRule
from kvc_testing import peers
from kvc_testing.peers import InProcessPeer, Local, Peer, PeerSpec

KiB = 1024
POOL, CHUNK = 256 * KiB, 64 * KiB  # staged kinds: 4 slots; a 64-block (1 MiB) plan is 16 chunks
MEMORY_DELAY_S = 0.01  # the memory transport completes a transfer this long after its post (at a poll) ...
P_SEED, D_SEED = 1, 100
_names = itertools.count()


@dataclasses.dataclass(frozen=True)
class Caps:
    """A transport kind and what it may do differently within the contract.

    first_poll_in_progress: a fresh multi-chunk (or delayed) transfer is IN_PROGRESS at its first
        poll. False where post may already have done the copy (NIXL: UCX copies inside post) or a
        worker thread may finish it before the first poll (Mooncake).
    remote_refused_at: where a plan outside the *peer's* registered regions fails: "post" (checked
        against the peer's advertised memory before anything moves) or "poll" (only the peer can
        refuse it: Mooncake's engine answers rc -1; a staging peer answers ERROR).
    gone_fails_in_flight: a transfer in flight when the peer disappears fails (deterministic for
        the in-process kinds; with a real engine the transfer may just finish first).
    gone_deadline_s: how soon after the peer disappears its transfers must have failed.
    known_defects: contract tests this kind fails today, by key (KNOWN_DEFECTS says what is wrong);
        they run as strict xfails, so a fix shows up as XPASS (then remove the key).
    fragments: staging "fragmented" (the KV registered with the engine too): the rule that picks
        the plans moved through the pool; the others move directly, as with the bare engine.
    """

    kind: str
    engine: str
    staged: bool
    first_poll_in_progress: bool
    remote_refused_at: str
    gone_fails_in_flight: bool
    gone_deadline_s: float
    known_defects: frozenset[str] = frozenset()
    wait_s: float = 20.0
    fragments: FragmentRule | None = None

    @property
    def in_process(self) -> bool:
        return self.engine == "memory"


KNOWN_DEFECTS = {
    "partial-remote-refusal": (
        "Mooncake checks only our side's addresses before posting; the peer's engine refuses just the"
        " runs outside its registered buffers (rc -1) and moves the valid runs of the same batch, so a"
        " refused plan has moved bytes. Fix: carry the registered ranges in Mooncake's local_metadata"
        " and check remote runs in _post, as NIXL's descriptor preparation does."
    ),
}

KINDS = {
    "memory": Caps("memory", "memory", False, True, "post", True, 1.0),
    "staged-memory": Caps("staged-memory", "memory", True, True, "poll", True, 3.0),
    "nixl": Caps("nixl", "nixl", False, False, "post", False, 5.0),
    "mooncake": Caps("mooncake", "mooncake", False, False, "post", False, 6.0),
    "staged-nixl": Caps("staged-nixl", "nixl", True, True, "poll", False, 8.0),
    "staged-mooncake": Caps("staged-mooncake", "mooncake", True, True, "poll", False, 8.0),
}
# Fragmented staging, both of its paths: every plan through the pool (as `on`, with the KV registered
# too), and every plan directly (the engine's own behaviour, through the staging transport's handle).
ALL_STAGED, NONE_STAGED = FragmentRule(1, 1 << 62), FragmentRule(1 << 62, 1)
for _engine in ("memory", "nixl", "mooncake"):
    KINDS[f"fragmented-staged-{_engine}"] = dataclasses.replace(
        KINDS[f"staged-{_engine}"], kind=f"fragmented-staged-{_engine}", fragments=ALL_STAGED
    )
    KINDS[f"fragmented-direct-{_engine}"] = dataclasses.replace(
        KINDS[_engine], kind=f"fragmented-direct-{_engine}", staged=True, fragments=NONE_STAGED
    )


def spec(caps: Caps, name: str, seed: int) -> PeerSpec:
    pool, chunk = (POOL, CHUNK) if caps.staged else (0, 0)
    return PeerSpec(caps.engine, name, seed, "staged", pool, chunk, fragments=caps.fragments)


class StepClock:
    """... on the fabric's clock, which advances only in Pair.pump(): a transfer is never done at
    the first poll after its post."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Pair:
    """P (a peer) and D (our transport), connected both ways, with waits that all have deadlines.

    pump() progresses both: D's notifications are collected into `notifs`, an in-process P steps."""

    caps: Caps
    d: Local
    p: Peer | InProcessPeer
    clock: StepClock | None = None
    notifs: list[tuple[str, bytes]] = dataclasses.field(default_factory=list)

    @property
    def t(self) -> Transport:
        return self.d.transport  # type: ignore[no-any-return]

    @property
    def p_layout(self) -> Any:
        assert self.p.layout is not None
        return self.p.layout

    def pump(self) -> None:
        if self.clock is not None:
            self.clock.now += MEMORY_DELAY_S
        self.notifs += self.t.get_notifs()
        self.p.step()

    def read_plan(self, src_ids: Any, dst_ids: Any) -> TransferPlan:
        return plan_transfer(self.p_layout, src_ids, self.d.layout, dst_ids)

    def write_plan(self, src_ids: Any, dst_ids: Any) -> TransferPlan:
        return plan_transfer(self.d.layout, src_ids, self.p_layout, dst_ids)

    def poll_states(self, handle: Any, timeout: float | None = None) -> list[XferState]:
        """Poll until DONE (errors propagate); every state seen, in order. Not released."""
        deadline = time.monotonic() + (self.caps.wait_s if timeout is None else timeout)
        states = [self.t.poll(handle)]
        while states[-1] is not XferState.DONE:
            assert time.monotonic() < deadline, f"{self.caps.kind}: transfer not done within the deadline: {states[-3:]}"
            self.pump()
            time.sleep(0.0005)
            states.append(self.t.poll(handle))
        return states

    def wait_p_notif(self, msg: bytes, timeout: float | None = None) -> str:
        """P's storage digest when it got msg from D."""
        return self.p.wait_notif(self.t.name, msg, self.caps.wait_s if timeout is None else timeout, on_wait=self.pump)

    def wait_d_notif(self, msg: bytes, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.caps.wait_s if timeout is None else timeout)
        while (self.p.name, msg) not in self.notifs:
            assert time.monotonic() < deadline, f"{self.caps.kind}: D did not get {msg!r} (got {self.notifs})"
            self.pump()
            time.sleep(0.001)
        self.notifs.remove((self.p.name, msg))

    def wait_slots_free(self) -> None:
        """Staged kinds: neither side holds a slot (progressing both meanwhile)."""
        if not self.caps.staged:
            return
        deadline = time.monotonic() + self.caps.wait_s
        while self.t.pool_stats()["slots_in_use"] or self.t.pool_stats()["queued"]:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, f"D still holds slots: {self.t.pool_stats()}"  # type: ignore[attr-defined]
            self.pump()
            time.sleep(0.001)
        while True:
            stats = self.p.call("stats")
            if stats["slots_in_use"] == 0 and stats["queued"] == 0:
                return
            assert time.monotonic() < deadline, f"P still holds slots: {stats}"
            self.pump()
            time.sleep(0.001)

    def p_dump(self) -> list[np.ndarray]:
        self.p.step()
        return self.p.call("dump")  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=list(KINDS))
def caps(request: Any) -> Caps:
    return KINDS[request.param]


@pytest.fixture(scope="module")
def remote(caps: Caps) -> Iterator[list[Peer]]:
    """The module's peer process for a real engine (empty for the memory kinds); a test that made it
    disappear leaves a dead one, which `pair` replaces."""
    started: list[Peer] = []
    with peers.loopback_env():
        try:
            yield started
        finally:
            peers.stop_peers(started)


@pytest.fixture
def pair(caps: Caps, remote: list[Peer], request: pytest.FixtureRequest) -> Iterator[Pair]:
    d_spec = spec(caps, f"d{next(_names)}-{caps.kind}-{os.getpid()}", D_SEED)
    clock = None
    if caps.in_process:
        clock = StepClock()
        fabric = MemoryFabric(clock=clock)
        p: Peer | InProcessPeer = peers.start_in_process(
            spec(caps, f"p-{caps.kind}", P_SEED), caps.wait_s, fabric=fabric, delay_s=MEMORY_DELAY_S
        )
        kwargs: dict[str, Any] = {"fabric": fabric, "delay_s": MEMORY_DELAY_S}
    else:
        if not remote or not remote[-1].alive:
            remote += peers.start_peers([spec(caps, f"p{next(_names)}-{caps.kind}", P_SEED)], caps.wait_s)
        p = remote[-1]
        assert p.call("reset", P_SEED) == "ok"
        p.inbox.clear()
        p.call("notifs")  # drop what earlier tests left
        kwargs = {}
    loc = peers.open_local(d_spec, [p], **kwargs)
    try:
        yield Pair(caps, loc, p, clock)
        if caps.fragments is not None:  # each fragmented kind took only the path it is named for
            posts = loc.transport.pool_stats()
            # an empty plan has nothing to stage: it is always posted directly (its notification only)
            other = "direct_posts" if caps.fragments is ALL_STAGED else "staged_posts"
            if not (other == "direct_posts" and request.node.name.startswith("test_empty_plan")):
                assert posts[other] == 0, f"{caps.kind}: {posts[other]} {other.split('_')[0]} transfers"
    finally:
        loc.close()
        if caps.in_process:
            peers.stop_peers([p])
