"""Fragmented staging (direct.py): a StagedTransport with a FragmentRule registers its KV with the inner
transport too; a plan of many short runs goes through the pool, any other plan moves directly, when
the peer did the same. Bytes, notifications (also one that looks like a staging message), release,
settle and the peer's metadata of an older version, over one MemoryFabric on a clock the test moves."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kv_connectors.errors import ConfigError
from kv_connectors.plan import TransferPlan, plan_transfer
from kv_connectors.transports.base import XferState
from kv_connectors.transports.memory import MemoryFabric, MemoryTransport, host_layout
from kv_connectors.transports.staging import MSG_MAGIC, StagedTransport
from kv_connectors.transports.staging.direct import DirectXfer, FragmentRule
from kv_connectors.transports.staging.messages import MD_MAGIC, StagedInfo
from kv_connectors.transports.staging.xfer import StagedXfer
from tests.unit.engine.engine_harness import FakeClock, StagedNode

KiB = 1024
BLOCKS = 16
RULE = FragmentRule(min_runs=4, max_mean_run=2 * KiB)  # 4+ runs under 2 KiB on average: staged
SEQUENTIAL = (list(range(8)), list(range(8, 16)))  # one 8 KiB run
SHUFFLED = ([7, 0, 5, 2, 3, 6, 1, 4], [9, 14, 8, 15, 11, 10, 13, 12])  # 8 runs of 1 KiB


class Net:
    def __init__(self, rules: dict[str, FragmentRule | None], delay_s: float = 0.0) -> None:
        self.clock = FakeClock()
        self.fabric = MemoryFabric(self.clock)
        self.nodes: dict[str, StagedNode] = {}
        for i, (name, rule) in enumerate(rules.items()):
            kv = np.random.default_rng(i).integers(0, 256, BLOCKS * KiB, dtype=np.uint8)
            inner = MemoryTransport(name, self.fabric, delay_s)
            t = StagedTransport(inner, pool_bytes=8 * KiB, chunk_bytes=2 * KiB, clock=self.clock, fragments=rule)
            layout = host_layout(kv, num_blocks=BLOCKS, block_size=1, num_regions=1)
            t.register(layout)
            self.nodes[name] = StagedNode(t, kv, layout)
        for a in self.nodes:
            for b in self.nodes:
                if a != b:
                    self.nodes[a].t.connect(b, self.nodes[b].t.local_metadata())
        self.got: dict[str, list[tuple[str, bytes]]] = {n: [] for n in self.nodes}

    def __getitem__(self, name: str) -> StagedTransport:
        return self.nodes[name].t

    def plan(self, src: str, dst: str, ids: tuple[list[int], list[int]]) -> TransferPlan:
        return plan_transfer(self.nodes[src].layout, ids[0], self.nodes[dst].layout, ids[1])  # type: ignore[arg-type]

    def pump(self, rounds: int = 5) -> None:
        for _ in range(rounds):
            self.clock.advance(0.01)
            for name, node in self.nodes.items():
                self.got[name] += node.t.get_notifs()

    def finish(self, who: str, handle: StagedXfer | DirectXfer) -> None:
        for _ in range(200):
            if self[who].poll(handle) is XferState.DONE:
                self.pump()
                return
            self.pump(1)
        raise AssertionError(f"{who}'s transfer did not finish: {handle}")

    def blocks(self, name: str, ids: list[int]) -> list[bytes]:
        kv = self.nodes[name].kv
        return [kv[b * KiB : (b + 1) * KiB].tobytes() for b in ids]


def test_the_rule_stages_many_short_runs_only() -> None:
    def plan(runs: int, run_bytes: int) -> TransferPlan:
        a = np.arange(runs, dtype=np.int64) * run_bytes * 2
        return TransferPlan(a, a, np.full(runs, run_bytes, dtype=np.int64), runs)

    assert RULE.staged(plan(8, KiB))
    assert not RULE.staged(plan(3, KiB)), "too few runs: the pool's round trips cost more than the runs"
    assert not RULE.staged(plan(8, 2 * KiB)), "runs as long as the limit move directly"
    with pytest.raises(ConfigError):
        FragmentRule(min_runs=0, max_mean_run=KiB)


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_a_coalesced_plan_moves_directly_and_a_shuffled_one_through_the_pool(write: bool) -> None:
    net = Net({"p": RULE, "d": RULE})
    src, dst = ("d", "p") if write else ("p", "d")
    post = net["d"].post_write if write else net["d"].post_read
    for ids, kind, staged_bytes in ((SEQUENTIAL, DirectXfer, 0), (SHUFFLED, StagedXfer, 8 * KiB)):
        before = net["d"].pool_stats()["bytes_staged"]
        handle = post("p", net.plan(src, dst, ids), b"done")
        assert isinstance(handle, kind)
        net.finish("d", handle)
        net["d"].release(handle)
        assert net.blocks(dst, ids[1]) == net.blocks(src, ids[0])
        assert net["d"].pool_stats()["bytes_staged"] - before == staged_bytes
        assert net.got["p"] == [("d", b"done")], "the notification arrives once, after the bytes"
        net.got["p"].clear()
    stats = net["d"].pool_stats()
    assert (stats["direct_posts"], stats["staged_posts"]) == (1, 1)


def test_a_direct_notification_that_looks_like_a_staging_message_arrives_as_sent() -> None:
    net = Net({"p": RULE, "d": RULE})
    notif = MSG_MAGIC + b"not a staging message"
    handle = net["d"].post_read("p", net.plan("p", "d", SEQUENTIAL), notif)
    assert isinstance(handle, DirectXfer)
    net.finish("d", handle)
    assert net.got["p"] == [("d", notif)]


@pytest.mark.parametrize("rules", [{"p": None, "d": RULE}, {"p": RULE, "d": None}], ids=["peer-stages-only", "we-stage-only"])
def test_without_both_sides_registered_every_plan_goes_through_the_pool(rules: dict[str, FragmentRule | None]) -> None:
    net = Net(rules)
    handle = net["d"].post_read("p", net.plan("p", "d", SEQUENTIAL), b"")
    assert isinstance(handle, StagedXfer)
    net.finish("d", handle)
    assert net.blocks("d", SEQUENTIAL[1]) == net.blocks("p", SEQUENTIAL[0])


def test_a_released_direct_transfer_is_settled_by_its_inner_transport() -> None:
    net = Net({"p": RULE, "d": RULE}, delay_s=0.5)
    handle = net["d"].post_read("p", net.plan("p", "d", SEQUENTIAL), b"")
    assert isinstance(handle, DirectXfer)
    assert net["d"].poll(handle) is XferState.IN_PROGRESS
    net["d"].release(handle)
    assert not net["d"].settled(handle), "its bytes may still land: the inner transfer has not ended"
    for _ in range(100):
        net.pump(1)
        if net["d"].settled(handle):
            break
    assert net["d"].settled(handle)


def test_metadata_of_a_peer_without_the_field_reads_as_not_direct() -> None:
    old = MD_MAGIC + msgspec.msgpack.encode([b"inner", 4096, 8 * KiB, 2 * KiB, 1024])  # StagedInfo before kv_direct
    info = msgspec.msgpack.decode(old[len(MD_MAGIC) :], type=StagedInfo)
    assert info.kv_direct is False
