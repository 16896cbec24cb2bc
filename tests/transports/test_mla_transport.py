"""MLA's KV cache over the real engines: per layer one (num_blocks, block_size, 576) float16 tensor
(kv_lora_rank + qk_rope_head_dim values per token, no head dimension, the same on every TP rank),
registered with NIXL and Mooncake in two processes (and the memory transport in one), planned by
the project's planner from `cells_of_tensor`'s cells and moved with READ (pull) and WRITE (push).
The destination is compared byte for byte with a numpy gather of the source's tokens
(`kvbuffers.token_copy`); every byte outside the plan is compared with what was there before.

Covered: whole blocks at one block size (`plan_blocks`, as the receiver and sender call it);
tensor parallelism (the latent is replicated: each decode rank loads it from the one prefill rank
`source_ranks` names, every prefill rank is loaded by `reader_count` decode ranks, whole blocks);
block sizes 16 and 32 both ways, token by token (`plan_cells` with the block tables the receiver
and sender build: D already holds its first block, the last blocks are partial)."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kv_connectors.layout import KVLayout
from kv_connectors.plan import BlockTable, TransferPlan, plan_blocks, plan_cells, plan_transfer
from kv_connectors.tp import rank_heads, reader_count, source_ranks
from kv_connectors.transports.base import Op
from kv_connectors.transports.memory import MemoryFabric
from kvc_testing import kvbuffers, peers
from kvc_testing.kvbuffers import MLA_HEADS, MLA_LATENT, MLA_LAYERS
from kvc_testing.peers import InProcessPeer, Local, Peer, PeerSpec
from tests.transports.helpers import random_pairs, wait_all

pytestmark = pytest.mark.timeout(180)

WAIT_S = 15.0
F16 = 2
TOKEN_BYTES = MLA_LATENT * F16
PEERS = {"a": (1, "mla"), "b": (2, "mla"), "c": (3, "mla32")}  # name -> (seed, profile); a and b: two TP ranks
OF_BLOCK_SIZE = {16: "a", 32: "c"}  # the peer holding blocks of that many tokens
LOCAL_SEED = 100
SEQ_TOKENS = 87  # 5 blocks of 16 + 7, or 2 of 32 + 23: every last block is partial
_names = itertools.count()
Storage = list[np.ndarray]
Planner = Callable[[KVLayout, KVLayout], TransferPlan]  # (P's layout, D's layout) -> the plan
Reference = Callable[[Storage, Storage], None]  # (destination, source): the expected move, in place


@dataclasses.dataclass
class Rig:
    """One transport kind's peers (spawned processes; in this process over a fabric for "memory")."""

    kind: str
    peers: dict[str, Peer | InProcessPeer]
    fabric: MemoryFabric | None
    locals: dict[str, Local] = dataclasses.field(default_factory=dict)  # ours, by profile

    def step(self) -> None:
        for p in self.peers.values():
            p.step()

    def reset(self) -> None:
        """Every peer back to its seed's bytes, nothing left in its inbox."""
        for name, p in self.peers.items():
            assert p.call("reset", PEERS[name][0]) == "ok"
            p.inbox.clear()
            p.call("notifs")

    def local(self, profile: str, seed: int = LOCAL_SEED) -> Local:
        """Our own transport over a KV cache of profile holding seed's bytes, connected both ways with
        every peer (one per profile for the module: a Mooncake engine takes a second to close)."""
        if profile not in self.locals:
            kwargs = {} if self.fabric is None else {"fabric": self.fabric}
            spec = PeerSpec(self.kind, f"mla-{next(_names)}-{os.getpid()}", seed, profile)
            self.locals[profile] = peers.open_local(spec, list(self.peers.values()), **kwargs)
        loc = self.locals[profile]
        refill(loc.storage, seed, profile)
        return loc

    def close(self) -> None:
        for loc in self.locals.values():
            loc.close()
        peers.stop_peers(list(self.peers.values()))

    def move(self, loc: Local, peer: Peer | InProcessPeer, op: Op, plan: TransferPlan, tag: bytes) -> str:
        """Post plan (READ from the peer, WRITE into it) with a notification, wait until it is done
        and the peer got the notification; the peer's storage digest when it got it."""
        t = loc.transport
        handle = t.post_read(peer.name, plan, tag) if op is Op.READ else t.post_write(peer.name, plan, tag)
        wait_all(t, [handle], WAIT_S, on_poll=self.step)
        return peer.wait_notif(t.name, tag, on_wait=self.step)


@pytest.fixture(scope="module", params=["memory", "nixl", "mooncake"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    kind = str(request.param)
    specs = [PeerSpec(kind, f"mla-{name}-{kind}-{os.getpid()}", seed, profile) for name, (seed, profile) in PEERS.items()]
    started: list[Peer | InProcessPeer] = []
    with peers.loopback_env():
        try:
            fabric = MemoryFabric() if kind == "memory" else None
            if fabric is not None:
                for spec in specs:
                    started.append(peers.start_in_process(spec, WAIT_S, fabric=fabric))
            else:
                started += peers.start_peers(specs, WAIT_S)
            rig = Rig(kind, dict(zip(PEERS, started)), fabric)
        except BaseException:
            peers.stop_peers(started)
            raise
        try:
            yield rig
        finally:
            rig.close()


@pytest.fixture
def fresh(rig: Rig) -> Rig:
    rig.reset()
    return rig


def refill(storage: Storage, seed: int, profile: str) -> None:
    """Storage (registered: kept in place) holds seed's bytes again."""
    for a, b in zip(storage, kvbuffers.make_kv(seed, profile)):
        a[...] = b


def _with_rank(layout: KVLayout, tp_size: int, rank: int) -> KVLayout:
    """The layout as TP rank `rank` of tp_size describes it (its first head: rank_heads)."""
    assert layout.cells is not None
    first, heads = rank_heads(MLA_HEADS, tp_size, rank)
    assert heads == layout.cells.heads
    return dataclasses.replace(layout, cells=layout.cells.with_first_head(first))


def _check_moved(op: Op, loc: Local, peer: Peer | InProcessPeer, digest: str, source: Storage) -> Storage:
    """The destination's bytes after a move; the source's are unchanged."""
    if op is Op.READ:
        assert kvbuffers.same_bytes(peer.call("dump"), source), "the source changed"
        return loc.storage
    assert kvbuffers.same_bytes(loc.storage, source), "the source changed"
    got: Storage = peer.call("dump")
    assert digest == kvbuffers.storage_digest(got), "the notification arrived before the data"
    return got


def _tokens(rig: Rig, op: Op, p_bs: int, d_bs: int, plan_of: Planner, ref: Reference) -> TransferPlan:
    """Move one plan between a P of p_bs tokens per block and a D of d_bs (the peer is P for READ,
    D for WRITE; we are the other); the destination must equal ref(copy of itself, source)."""
    profile = {16: "mla", 32: "mla32"}
    peer = rig.peers[OF_BLOCK_SIZE[p_bs if op is Op.READ else d_bs]]
    loc = rig.local(profile[d_bs if op is Op.READ else p_bs])
    assert peer.layout is not None
    p_layout, d_layout = (peer.layout, loc.layout) if op is Op.READ else (loc.layout, peer.layout)
    plan = plan_of(p_layout, d_layout)
    remote = peer.call("dump")
    src, dst = (remote, loc.storage) if op is Op.READ else (loc.storage, remote)
    expected = [a.copy() for a in dst]
    ref(expected, src)
    assert not kvbuffers.same_bytes(expected, dst), "the plan's tokens are already there: the test would prove nothing"
    source = [a.copy() for a in src]
    digest = rig.move(loc, peer, op, plan, f"{op}-{p_bs}-{d_bs}".encode())
    got = _check_moved(op, loc, peer, digest, source)
    assert kvbuffers.same_bytes(got, expected), f"{rig.kind} {op}: the destination differs from the reference gather"
    return plan


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_whole_blocks_at_one_block_size(fresh: Rig, op: Op) -> None:
    """12 blocks of 16 tokens, shuffled, two runs consecutive on both sides: whole-block runs, coalesced."""
    p_ids, d_ids = random_pairs(np.random.default_rng(5), kvbuffers.MLA_BLOCKS)
    tokens = len(p_ids) * 16

    def plan_of(p: KVLayout, d: KVLayout) -> TransferPlan:
        return plan_blocks(p, p_ids, d, d_ids)

    def ref(dst: Storage, src: Storage) -> None:
        kvbuffers.token_copy(dst, src, BlockTable(p_ids), BlockTable(d_ids), 0, tokens)

    plan = _tokens(fresh, op, 16, 16, plan_of, ref)
    assert plan.total_bytes == MLA_LAYERS * tokens * TOKEN_BYTES
    assert MLA_LAYERS < plan.num_runs < MLA_LAYERS * len(p_ids)  # partly coalesced


@pytest.mark.parametrize(("p_bs", "d_bs"), [(16, 32), (32, 16)])
@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_other_block_sizes_token_by_token_after_ds_prefix(fresh: Rig, op: Op, p_bs: int, d_bs: int) -> None:
    """An 87-token prompt, D holding its first block already: D's remaining tokens only, through both
    block tables as the receiver (READ: P's blocks from the one holding D's first missing token) and
    the sender (WRITE: all of P's blocks) build them; the partial last blocks' tail slots untouched."""
    rng = np.random.default_rng(p_bs)
    first = d_bs  # D's prefix-cache hit: its first block
    count = SEQ_TOKENS - first
    p_all = rng.permutation(kvbuffers.MLA_BLOCKS * 16 // p_bs)[: -(-SEQ_TOKENS // p_bs)].tolist()
    d_new = rng.permutation(kvbuffers.MLA_BLOCKS * 16 // d_bs)[: -(-count // d_bs)].tolist()
    d_table = BlockTable(d_new, first)
    p_table = BlockTable(p_all[first // p_bs :], first - first % p_bs) if op is Op.READ else BlockTable(p_all)

    def plan_of(p: KVLayout, d: KVLayout) -> TransferPlan:
        return plan_cells(p, p_table, d, d_table, first, count)

    def ref(dst: Storage, src: Storage) -> None:
        kvbuffers.token_copy(dst, src, p_table, d_table, first, count)

    plan = _tokens(fresh, op, p_bs, d_bs, plan_of, ref)
    assert plan.total_bytes == MLA_LAYERS * count * TOKEN_BYTES


def _tp_read(rig: Rig, p_tp: int, d_tp: int, p_ids: list[int], d_ids: list[int]) -> dict[int, int]:
    """Each D rank of d_tp (in turn, on our one KV cache refilled with its own bytes) reads the latent
    from the P rank source_ranks names; how many D ranks read each P rank."""
    readers = dict.fromkeys(range(p_tp), 0)
    for r in range(d_tp):
        sources = source_ranks(MLA_HEADS, p_tp, d_tp, r)
        assert len(sources) == 1, f"D rank {r} of {d_tp} would load the replicated latent from P ranks {sources}"
        p = sources[0]
        loc, peer = rig.local("mla", LOCAL_SEED + r), rig.peers["ab"[p]]
        assert peer.layout is not None
        plan = plan_blocks(_with_rank(peer.layout, p_tp, p), p_ids, _with_rank(loc.layout, d_tp, r), d_ids)
        assert plan.runs() == plan_transfer(peer.layout, p_ids, loc.layout, d_ids).runs()  # whole blocks
        expected = kvbuffers.make_kv(LOCAL_SEED + r, "mla")
        kvbuffers.block_copy(expected, kvbuffers.make_kv(PEERS["ab"[p]][0], "mla"), p_ids, d_ids)
        rig.move(loc, peer, Op.READ, plan, f"tp-{p_tp}-{d_tp}-{r}".encode())
        assert kvbuffers.same_bytes(loc.storage, expected), f"D rank {r} of {d_tp} does not hold P rank {p}'s latent alone"
        readers[p] += 1
    return readers


def _tp_write(rig: Rig, p_tp: int, d_tp: int, p_ids: list[int], d_ids: list[int]) -> dict[int, int]:
    """Each P rank of p_tp (in turn, on our one KV cache refilled with its own bytes) writes the latent
    into every D rank (peers a, b) whose source_ranks name it; how many D ranks each P rank wrote."""
    written = dict.fromkeys(range(p_tp), 0)
    expected = {r: kvbuffers.make_kv(PEERS["ab"[r]][0], "mla") for r in range(d_tp)}
    for p in range(p_tp):
        loc = rig.local("mla", LOCAL_SEED + p)
        for r in [r for r in range(d_tp) if p in source_ranks(MLA_HEADS, p_tp, d_tp, r)]:
            peer = rig.peers["ab"[r]]
            assert peer.layout is not None
            plan = plan_blocks(_with_rank(loc.layout, p_tp, p), p_ids, _with_rank(peer.layout, d_tp, r), d_ids)
            kvbuffers.block_copy(expected[r], loc.storage, p_ids, d_ids)
            digest = rig.move(loc, peer, Op.WRITE, plan, f"tp-{p_tp}-{d_tp}-{p}-{r}".encode())
            assert digest == kvbuffers.storage_digest(expected[r]), "the notification arrived before the data"
            written[p] += 1
    for r in range(d_tp):
        got = rig.peers["ab"[r]].call("dump")
        assert kvbuffers.same_bytes(got, expected[r]), f"D rank {r} of {d_tp} does not hold one P rank's latent alone"
    return written


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 2), (2, 4)])
def test_tp_each_decode_rank_reads_the_latent_from_one_prefill_rank(fresh: Rig, p_tp: int, d_tp: int) -> None:
    """P's ranks are peers a and b (other bytes each, so a D rank's bytes tell which one it read)."""
    p_ids, d_ids = [7, 8, 9, 2, 15], [0, 1, 5, 6, 11]  # every rank names the same blocks
    readers = _tp_read(fresh, p_tp, d_tp, p_ids, d_ids)
    assert readers == {p: reader_count(MLA_HEADS, p_tp, d_tp, p) for p in range(p_tp)}


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 2)])
def test_tp_each_prefill_rank_writes_the_latent_into_the_decode_ranks_it_serves(fresh: Rig, p_tp: int, d_tp: int) -> None:
    """D's ranks are peers a and b; each ends up holding exactly one P rank's latent in the planned blocks."""
    p_ids, d_ids = [3, 4, 10, 21], [12, 13, 14, 0]
    written = _tp_write(fresh, p_tp, d_tp, p_ids, d_ids)
    assert written == {p: reader_count(MLA_HEADS, p_tp, d_tp, p) for p in range(p_tp)}
