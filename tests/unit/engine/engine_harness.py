"""A P and a D worker engine over one in-process fabric (memory transport, in-process side
channel) with a clock the test moves: each state-machine path runs deterministically in ms."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from kv_connectors import wire
from kv_connectors.config import parse_config
from kv_connectors.layout import token_major
from kv_connectors.specs import ProducerAddress, RecvSpec, SendSpec, StepMetadata
from kv_connectors.tp import rank_heads
from kv_connectors.transports.memory import MemoryClient, MemoryFabric, MemoryTransport, host_layout
from kv_connectors.transports.staging import StagedTransport
from kv_connectors.worker import WorkerEngine

NUM_BLOCKS = 16
BLOCK_SIZE = 4
BLOCK_WORDS = 64  # float32 words per block per region
CELL_WORDS = 8  # with heads: float32 words of one token of one head
P_PORT, D_PORT, D2_PORT = 7001, 7011, 7021  # apart: a TP rank r listens on port + r in the rank layout
# D claims every read (no lease words): the tests of the claim path itself.
CLAIM_ONLY = {"lease_words": False}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def compat_for(layout: Any, heads: int = 1) -> wire.CompatInfo:
    return wire.CompatInfo(
        architecture="Tiny",
        num_layers=1,
        hidden_size=8,
        num_kv_heads=heads,
        head_size=8,
        vocab_size=16,
        dtype="float32",
        block_size=BLOCK_SIZE,
        layout=layout.compat_signature(),
    )


class HeldClient:
    """A node's side-channel client whose answers the test can hold back: with `holding` set, the
    peer handles each request at once (as over a real socket) but the answer reaches the caller only
    at `deliver()` (a slow network on the way back)."""

    def __init__(self, inner: MemoryClient) -> None:
        self._inner = inner
        self.holding = False
        self.hold_types: tuple[type, ...] = ()  # answers to these requests are held even when not holding
        self._held: list[tuple[concurrent.futures.Future[wire.Body], concurrent.futures.Future[wire.Body]]] = []

    def submit(
        self, host: str, port: int, body: wire.Body, compat_hash: str, timeout_s: float
    ) -> concurrent.futures.Future[wire.Body]:
        answered = self._inner.submit(host, port, body, compat_hash, timeout_s)
        if not self.holding and not isinstance(body, self.hold_types):
            return answered
        late: concurrent.futures.Future[wire.Body] = concurrent.futures.Future()
        self._held.append((answered, late))
        return late

    def deliver(self) -> int:
        """Hand every held answer to its caller; returns how many were held."""
        held, self._held = self._held, []
        for answered, late in held:
            if late.cancelled() or not answered.done():
                continue
            if answered.exception() is not None:
                late.set_exception(answered.exception())  # type: ignore[arg-type]
            else:
                late.set_result(answered.result())
        return len(held)

    def forget(self, host: str, port: int) -> None:
        self._inner.forget(host, port)

    def listening(self, host: str, port: int) -> concurrent.futures.Future[bool]:
        return self._inner.listening(host, port)

    def close(self) -> None:
        self._inner.close()


@dataclasses.dataclass
class StagedNode:
    """A StagedTransport over the memory fabric with its KV buffer and layout (the staging tests' peers)."""

    t: StagedTransport
    kv: np.ndarray
    layout: object


@dataclasses.dataclass
class Node:
    engine: WorkerEngine
    kv: np.ndarray  # (regions, blocks, words)
    transport: MemoryTransport
    client: HeldClient
    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: set[str] = dataclasses.field(default_factory=set)
    recv_reports: list[str] = dataclasses.field(default_factory=list)  # every finished report, in order
    # Idle waits (kv_connectors.idle): each wait's delay, recorded instead of slept (a wait that a
    # wake already ended returns at once, as the Event's does); during_wait, if set, runs in the
    # wait (what arrives meanwhile) and says whether it woke the engine.
    waits: list[float] = dataclasses.field(default_factory=list)
    woken_at_once: int = 0
    during_wait: Callable[[], bool] | None = None

    def idle_wait(self, delay_s: float) -> bool:
        self.waits.append(delay_s)
        if self.engine.pacer.woken:
            self.woken_at_once += 1
            return True
        return self.during_wait() if self.during_wait is not None else False

    def step(self, meta: StepMetadata | None = None, layers: tuple[str, ...] = (), idle: bool = False) -> None:
        """One engine step as vLLM drives it: bind metadata, start_load_kv, the forward pass (each
        layer's save hook), wait_for_save, get_finished. idle: the step schedules no token."""
        if idle:
            meta = dataclasses.replace(meta or StepMetadata(), idle=True)
        if meta is not None:
            self.engine.before_forward(meta)
        self.engine.start_load(meta)
        for layer in layers:
            self.engine.on_layer_saved(layer)
        self.engine.end_of_forward()
        sending, recving, failed = self.engine.take_results()
        self.finished_sending |= sending
        self.finished_recving |= recving
        self.recv_reports += sorted(recving)
        self.failed_recving |= failed

    def block(self, block_id: int) -> np.ndarray:
        return self.kv[:, block_id, :].copy()


class Cluster:
    """P (producer) and one or two D (consumer) engines."""

    def __init__(
        self,
        p_extra: dict | None = None,
        d_extra: dict | None = None,
        d_delay_s: float = 0.0,
        p_tp: int = 1,
        d_tp: int = 1,
        heads: int | None = None,
        p_block: int = BLOCK_SIZE,
        d_block: int = BLOCK_SIZE,
        aborting: bool = False,
    ) -> None:
        """p_tp, d_tp: the TP sizes P's and D's rank 0 (self.p, self.d) run with (add_rank adds the
        others). heads: the model's KV heads; each rank's blocks then hold its slice of them, as
        cells of CELL_WORDS words (without, blocks are opaque: whole blocks only). p_block, d_block:
        tokens per block (with heads only, where they differ)."""
        self.heads = heads
        self.block = {"kv_producer": p_block, "kv_consumer": d_block}
        self._ranks: dict[tuple[str, int], dict[int, WorkerEngine]] = {}  # each instance's ranks so far
        self.clock = FakeClock()
        self.fabric = MemoryFabric(self.clock, aborting=aborting)  # aborting: release() stops a transfer (no real engine does)
        self.p = self._node(
            "P", "kv_producer", P_PORT, {"lease_s": 5, "transfer_timeout_s": 10, **(p_extra or {})}, fill=1.0, tp_size=p_tp
        )
        self.d = self._node(
            "D",
            "kv_consumer",
            D_PORT,
            {"handshake_timeout_s": 2, "transfer_timeout_s": 10, **(d_extra or {})},
            fill=-1.0,
            delay_s=d_delay_s,
            tp_size=d_tp,
        )

    def _node(
        self,
        engine_id: str,
        role: str,
        port: int,
        extra: dict,
        fill: float,
        delay_s: float = 0.0,
        rank: int = 0,
        tp_size: int = 1,
    ) -> Node:
        """One worker engine; a TP rank r > 0 listens on port + r (its config names the base port)."""
        cfg = parse_config(engine_id, role, {"side_channel_port": port, **extra})
        first, heads = (0, 1) if self.heads is None else rank_heads(self.heads, tp_size, rank)
        block_size = self.block[role]
        words = BLOCK_WORDS if self.heads is None else heads * block_size * CELL_WORDS
        kv = np.zeros((2, NUM_BLOCKS, words), dtype=np.float32)
        # Block b of a node holds fill * (b + 1) everywhere: a copy is recognisable by its value.
        kv[:] = fill * (np.arange(NUM_BLOCKS, dtype=np.float32)[None, :, None] + 1)
        layout = host_layout(kv, NUM_BLOCKS, block_size)
        if self.heads is not None:  # (regions, blocks, heads, tokens, cell)
            cell = CELL_WORDS * 4
            cells = token_major(heads, block_size * cell, block_size, cell, cell, first)
            layout = dataclasses.replace(layout, cells=cells)
        made: list[MemoryTransport] = []

        def make(name: str) -> MemoryTransport:
            made.append(MemoryTransport(name, self.fabric, delay_s=delay_s))
            return made[-1]

        client = HeldClient(self.fabric.client())
        owner: list[Node] = []  # the node, once made: its idle_wait records the engine's waits
        engine = WorkerEngine(
            cfg,
            rank,
            make,
            "memory",
            serve=self.fabric.serve,
            client=client,
            clock=self.clock,
            tp_size=tp_size,
            idle_wait=lambda delay_s: owner[0].idle_wait(delay_s),
        )
        # Each region is one "layer" (layer-wise push writes a layer's regions as it is computed).
        compat = compat_for(layout, self.heads or 1)
        engine.register(layout, compat, layer_regions={"layer.0": (0,), "layer.1": (1,)})
        node = Node(engine, kv, made[-1], client)
        owner.append(node)
        self._gather(engine_id, port, rank, tp_size, engine)
        return node

    def _gather(self, engine_id: str, port: int, rank: int, tp_size: int, engine: WorkerEngine) -> None:
        """What the adapter's gather over the TP group does: once every rank of an instance is
        registered, each is given every rank's side-channel address (ranks > 0 listen where the
        fabric picked, as the system picks a port: config.PortLayout)."""
        ranks = self._ranks.setdefault((engine_id, port), {})
        ranks[rank] = engine
        if sorted(ranks) == list(range(tp_size)):
            addresses = [ranks[r].address for r in range(tp_size)]
            for each in ranks.values():
                each.set_directory(addresses)

    def add_rank(self, role: str, rank: int, tp_size: int, fill: float, extra: dict | None = None) -> Node:
        """Another tensor-parallel rank of P (role kv_producer) or D (kv_consumer), same base port."""
        if role == "kv_producer":
            base = {"lease_s": 5, "transfer_timeout_s": 10}
            return self._node("P", role, P_PORT, {**base, **(extra or {})}, fill=fill, rank=rank, tp_size=tp_size)
        base = {"handshake_timeout_s": 2, "transfer_timeout_s": 10}
        return self._node("D", role, D_PORT, {**base, **(extra or {})}, fill=fill, rank=rank, tp_size=tp_size)

    def add_consumer(self, engine_id: str = "D2", port: int = D2_PORT, extra: dict | None = None) -> Node:
        return self._node(
            engine_id, "kv_consumer", port, {"handshake_timeout_s": 2, "transfer_timeout_s": 10, **(extra or {})}, fill=-2.0
        )

    # P's side -----------------------------------------------------------------------------------
    def prefill_done(self, rid: str, blocks: tuple[int, ...], key: str | None = None) -> None:
        """P's scheduler finished a prefill for a D: its worker learns of it at the next step."""
        self.p.step(StepMetadata(reqs_to_send={rid: SendSpec(blocks, key or rid)}))

    def overwrite_p_block(self, block_id: int, value: float) -> None:
        self.p.kv[:, block_id, :] = value

    # D's side -----------------------------------------------------------------------------------
    @staticmethod
    def recv(node: Node, rid: str, remote_rid: str, local: tuple[int, ...], remote: tuple[int, ...], report: bool = True) -> None:
        node.step(
            StepMetadata(
                reqs_to_recv={rid: RecvSpec(ProducerAddress("P", "127.0.0.1", P_PORT), remote_rid, local, remote, report=report)}
            )
        )

    def run(self, steps: int = 5, dt: float = 0.001, nodes: tuple[Node, ...] | None = None, idle: bool = False) -> None:
        for _ in range(steps):
            self.clock.advance(dt)
            for node in nodes or (self.d, self.p):
                node.step(idle=idle)
