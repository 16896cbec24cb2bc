"""One peer harness for the transport tests, the transport contract suite and the transport benchmarks.

- KV caches: the tests' patterned profiles (`make_kv`, `layout_of`, `block_copy`, `storage_digest`,
  `same_bytes`; "mla" and "mla32" are MLA's latent, with cells, `token_copy` their token reference)
  and the benchmarks' word pattern over vLLM-shaped tensors (`Shape`, `bench_kv`, `fill_pattern`,
  `check_pattern`).
- Transports: `open_transport(spec)` builds any kind through `create_transport` (the one factory the
  connectors use), wrapped in a `StagedTransport` where the spec asks for a pool.
- The peer: `Server` holds one transport over one KV cache and answers commands; `serve` runs it in
  a spawned process over a pipe (`start_peers` / `stop_peers` / `Peer`), `InProcessPeer` runs it in
  this process (the memory transport, whose fabric cannot cross a process).
- The caller's own side: `open_local` (a transport over a patterned KV cache, connected both ways).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kv_connectors.config import ConnectorConfig, Role
from kv_connectors.errors import TransportError
from kv_connectors.layout import Cells, KVLayout, Part, TensorInfo, build_layout, cells_of_tensor
from kv_connectors.plan import BlockTable, plan_transfer
from kv_connectors.transports import create_transport, ucx_on_loopback
from kv_connectors.transports.base import MemoryKind, Transport, XferState

logger = logging.getLogger(__name__)

_CTX = mp.get_context("spawn")
STARTUP_S = 60.0  # a spawned peer imports numpy, torch and an engine: slow on a loaded 2-core machine
STOP_S = 5.0


# KV caches (tests) ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Profile:
    """A KV cache of storage arrays of dtype (random bits, compared byte for byte). Array i has its
    blocks on dimension block_dims[i]; where kv_cols[i] is set, only the first kv_cols[i] words of a
    block are KV (the rest is padding that must stay untouched). heads > 0: the layout has cells,
    read from the first array's shape with that many KV heads (cells_of_tensor)."""

    num_blocks: int
    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    block_dims: tuple[int, ...]
    kv_cols: tuple[int | None, ...]
    dtype: str = "uint32"
    heads: int = 0


SMALL_BLOCKS = 32  # "small": five regions, packed and padded ones, 512-byte segments
BIG_BLOCKS = 8192  # "big": one region of 4 KiB blocks, 32 MiB (long enough to be killed mid-read)
STAGED_BLOCKS = 320  # "staged": 16 KiB blocks over 4 regions (packed, K/V-split packed, padded)
MLA_LATENT = 576  # MLA's cache: kv_lora_rank 512 + qk_rope_head_dim 64 values per token, no head dimension
MLA_LAYERS = 2
MLA_HEADS = 1  # the latent is one KV head, replicated on every tensor-parallel rank
MLA_BLOCKS = 24  # "mla": (24, 16, 576) float16 per layer, 18 KiB blocks; "mla32": (12, 32, 576), 36 KiB


def _mla(num_blocks: int, block_size: int) -> Profile:
    shape = (num_blocks, block_size, MLA_LATENT)
    return Profile(num_blocks, block_size, (shape,) * MLA_LAYERS, (0,) * MLA_LAYERS, (None,) * MLA_LAYERS, "float16", MLA_HEADS)


PROFILES = {
    "small": Profile(
        SMALL_BLOCKS, 4, ((32, 2, 4, 16), (32, 2, 4, 16), (2, 32, 4, 2, 8), (32, 160)), (0, 0, 1, 0), (None, None, None, 128)
    ),
    "big": Profile(BIG_BLOCKS, 4, ((BIG_BLOCKS, 1024),), (0,), (None,)),
    "staged": Profile(STAGED_BLOCKS, 16, ((320, 2, 8, 64), (2, 320, 1024), (320, 1024 + 64)), (0, 1, 0), (None, None, 1024)),
    "mla": _mla(MLA_BLOCKS, 16),
    "mla32": _mla(MLA_BLOCKS // 2, 32),
}


def make_kv(seed: int, profile: str = "small") -> list[np.ndarray]:
    """Storage arrays filled with a pattern unique to seed (random bits: as floats, some are NaNs)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown KV profile {profile!r}")
    rng = np.random.default_rng(seed)
    prof = PROFILES[profile]
    if prof.dtype == "uint32":
        return [rng.integers(0, 2**32, size=s, dtype=np.uint32) for s in prof.shapes]
    size = np.dtype(prof.dtype).itemsize
    return [rng.integers(0, 256, size=int(np.prod(s)) * size, dtype=np.uint8).view(prof.dtype).reshape(s) for s in prof.shapes]


def profile_of(storage: Sequence[Any]) -> Profile:
    shapes = tuple(tuple(a.shape) for a in storage)
    for prof in PROFILES.values():
        if prof.shapes == shapes:
            return prof
    raise ValueError(f"storage of shapes {shapes} matches no KV profile")


def kv_views(storage: Sequence[Any]) -> list[Any]:
    """The KV tensors of the layout (numpy or torch); a padded tensor is a strided view of its storage."""
    return [a if cols is None else a[:, :cols] for a, cols in zip(storage, profile_of(storage).kv_cols)]


def _info(name: str, v: Any) -> TensorInfo:
    if isinstance(v, np.ndarray):
        return TensorInfo(name, v.ctypes.data, tuple(v.shape), tuple(s // v.itemsize for s in v.strides), v.itemsize)
    return TensorInfo(name, v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.element_size())


def layout_of(storage: Sequence[Any]) -> KVLayout:
    """The layout of a profile's storage arrays, numpy (host) or torch (any device); with the
    profile's cells where it names its heads (one rank's, from head 0: MLA's latent on every rank)."""
    prof = profile_of(storage)
    infos = [_info(f"t{i}", v) for i, v in enumerate(kv_views(storage))]
    layout = build_layout(infos, prof.num_blocks, block_size=prof.block_size)
    if not prof.heads:
        return layout
    return dataclasses.replace(layout, cells=cells_of_tensor(infos[0], prof.num_blocks, prof.block_size, prof.heads))


def block_copy(dst: Sequence[np.ndarray], src: Sequence[np.ndarray], src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    """Reference copy (in place on dst): what a transfer of src_ids -> dst_ids must produce."""
    s, d = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    prof = profile_of(dst)
    for i, (dim, cols) in enumerate(zip(prof.block_dims, prof.kv_cols)):
        tail = () if cols is None else (slice(0, cols),)  # padding is not part of the KV
        dst[i][(slice(None),) * dim + (d,) + tail] = src[i][(slice(None),) * dim + (s,) + tail]


def token_copy(
    dst: Sequence[np.ndarray], src: Sequence[np.ndarray], src_table: BlockTable, dst_table: BlockTable, first: int, count: int
) -> None:
    """Reference copy (in place on dst) for token-major profiles (blocks on dim 0, tokens on dim 1,
    every array: MLA): tokens [first, first + count) of a sequence from src's blocks (src_table) to
    dst's, a numpy gather, each side on its own block size (the arrays' dim 1)."""
    tokens = np.arange(first, first + count, dtype=np.int64)
    for d, s in zip(dst, src):
        s_blk, s_slot = np.divmod(tokens - src_table.first_token, s.shape[1])
        d_blk, d_slot = np.divmod(tokens - dst_table.first_token, d.shape[1])
        d[np.asarray(dst_table.ids)[d_blk], d_slot] = s[np.asarray(src_table.ids)[s_blk], s_slot]


def same_bytes(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Whether two lists of storage arrays hold the same bytes (floats compared as bits: NaNs too)."""
    return len(a) == len(b) and all(x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def storage_digest(storage: Sequence[np.ndarray]) -> str:
    """SHA-256 of all storage bytes, in order (what a peer had when a notification arrived)."""
    h = hashlib.sha256()
    for a in storage:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# KV caches (benchmarks) ----------------------------------------------------------------------
KV_HEADS = 2
HEAD_DIM_X2 = 64  # K and V fused in the last dim, as vLLM's CPU layout (num_blocks, heads, block_size, 2*head)
F32 = 4
SENTINEL = -0x2152411021524111  # 0xDEADBEEFDEADBEEF as int64: "not copied"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A KV cache of `layers` tensors (num_blocks, heads, block_size, HEAD_DIM_X2) float32: a
    tensor-parallel rank holding `heads` of the model's KV heads from first_head on."""

    size_mib: int
    block_kib: int
    layers: int
    heads: int = KV_HEADS
    first_head: int = 0

    @property
    def block_size(self) -> int:  # tokens per block giving block_kib KiB per layer segment
        return self.block_kib * 1024 // (self.heads * HEAD_DIM_X2 * F32)

    @property
    def num_blocks(self) -> int:
        return self.size_mib * 1024 // (self.block_kib * self.layers)

    def cells(self) -> Cells:
        """vLLM's CPU layout ("vec" kernels): per head, K transposed, then V token by token."""
        head = HEAD_DIM_X2 // 2
        k = Part(0, head, self.block_size * F32, F32, F32)
        v = Part(self.block_size * head * F32, 1, 0, head * F32, head * F32)
        return Cells(self.heads, 2 * self.block_size * head * F32, self.block_size, (k, v), self.first_head)

    @property
    def words_per_block(self) -> int:  # 64-bit words in one block segment
        return self.block_kib * 1024 // 8

    def check(self) -> None:
        if self.block_kib * 1024 % (self.heads * HEAD_DIM_X2 * F32) or self.block_size < 1:
            raise SystemExit(f"--block-kib must be a multiple of {self.heads * HEAD_DIM_X2 * F32 / 1024:g} KiB")
        if self.num_blocks < 1 or self.num_blocks * self.block_kib * self.layers != self.size_mib * 1024:
            raise SystemExit("--size-mib must be a multiple of --block-kib x --layers")


def bench_kv(shape: Shape, device: str = "cpu", fill: str = "") -> list[Any]:
    """The benchmark KV cache as torch tensors on device; fill "pattern", "sentinel" or "" (as allocated)."""
    import torch

    kv = [
        torch.empty((shape.num_blocks, shape.heads, shape.block_size, HEAD_DIM_X2), dtype=torch.float32, device=device)
        for _ in range(shape.layers)
    ]
    if fill == "pattern":
        fill_pattern(kv)
    elif fill == "sentinel":
        fill_sentinel(kv)
    elif fill:
        raise ValueError(f"unknown fill {fill!r}")
    return kv


def words(t: Any) -> Any:
    """A layer tensor as (num_blocks, words_per_block) int64: pattern and checks ignore floats."""
    import torch

    return t.view(t.shape[0], -1).view(torch.int64)


def fill_pattern(kv: Sequence[Any]) -> None:
    """Word w of block b of layer l holds (l << 40) | (b * words_per_block + w): every word is unique."""
    import torch

    for layer, t in enumerate(kv):
        w = words(t)
        w.copy_(torch.arange(w.numel(), dtype=torch.int64, device=t.device).view(w.shape) | (layer << 40))


def fill_sentinel(kv: Sequence[Any]) -> None:
    """Every word "not copied" (also prefaults the pages)."""
    for t in kv:
        words(t).fill_(SENTINEL)


def check_pattern(kv: Sequence[Any], src_ids: Any, dst_ids: Any) -> str | None:
    """None if destination block dst_ids[i] of every layer holds source block src_ids[i]; else what is wrong."""
    import torch

    for layer, t in enumerate(kv):
        w = words(t)
        wpb = w.shape[1]
        src = torch.as_tensor(np.asarray(src_ids), dtype=torch.int64, device=t.device)
        want = (src[:, None] * wpb + torch.arange(wpb, device=t.device)) | (layer << 40)
        if not torch.equal(w[torch.as_tensor(np.asarray(dst_ids), device=t.device)], want):
            return f"VERIFY FAILED: layer {layer} holds wrong bytes after the transfer"
    return None


def _tokens(kv: Sequence[Any], shape: Shape, ids: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, (K, V) of the sequence held in blocks ids, as (heads, tokens, head) float32 arrays:
    vLLM's CPU layout, K transposed then V token by token inside each head's block."""
    head = HEAD_DIM_X2 // 2
    bs, out = shape.block_size, []
    for t in kv:
        seg = t.cpu().numpy().reshape(shape.num_blocks, shape.heads, 2, bs * head)[np.asarray(ids)]
        k = seg[:, :, 0].reshape(-1, shape.heads, head, bs).transpose(1, 0, 3, 2).reshape(shape.heads, -1, head)
        v = seg[:, :, 1].reshape(-1, shape.heads, bs, head).transpose(1, 0, 2, 3).reshape(shape.heads, -1, head)
        out.append((k, v))
    return out


def check_tokens(dst_kv: Sequence[Any], dst: Shape, dst_ids: Any, src_kv: Sequence[Any], src: Shape, src_ids: Any) -> str | None:
    """None if the destination sequence (blocks dst_ids) holds the source sequence's (blocks
    src_ids) K and V token for token, for every head both hold; the block sizes may differ."""
    lo, hi = max(src.first_head, dst.first_head), min(src.first_head + src.heads, dst.first_head + dst.heads)
    n = min(len(src_ids) * src.block_size, len(dst_ids) * dst.block_size)
    for layer, (got, want) in enumerate(zip(_tokens(dst_kv, dst, dst_ids), _tokens(src_kv, src, src_ids))):
        for part, g, w in (("K", got[0], want[0]), ("V", got[1], want[1])):
            a = g[lo - dst.first_head : hi - dst.first_head, :n].view(np.int32)
            b = w[lo - src.first_head : hi - src.first_head, :n].view(np.int32)
            if not np.array_equal(a, b):
                return f"VERIFY FAILED: layer {layer} {part} differs token by token after the transfer"
    return None


def bench_layout(kv: Sequence[Any], shape: Shape) -> KVLayout:
    """The layout with its cells (which heads of the model it holds)."""
    infos = [_info(f"layer{i}", t) for i, t in enumerate(kv)]
    return dataclasses.replace(build_layout(infos, shape.num_blocks, shape.block_size, block_dim=0), cells=shape.cells())


def check_heads(kv: Sequence[Any], src_ids: Any, dst_ids: Any, src: Shape, dst: Shape) -> str | None:
    """None if every destination block dst_ids[i] holds, for each head both shapes hold, that
    head's words of source block src_ids[i] (fill_pattern's, on the source's own block size)."""
    import torch

    lo, hi = max(src.first_head, dst.first_head), min(src.first_head + src.heads, dst.first_head + dst.heads)
    head_words = src.block_size * HEAD_DIM_X2 * F32 // 8
    for layer, t in enumerate(kv):
        w = words(t).view(t.shape[0], dst.heads, head_words)
        s = torch.as_tensor(np.asarray(src_ids), dtype=torch.int64, device=t.device)
        d = torch.as_tensor(np.asarray(dst_ids), device=t.device)
        for h in range(lo, hi):
            first = s * src.words_per_block + (h - src.first_head) * head_words
            want = (first[:, None] + torch.arange(head_words, device=t.device)) | (layer << 40)
            if not torch.equal(w[d, h - dst.first_head], want):
                return f"VERIFY FAILED: layer {layer} head {h} holds wrong bytes after the transfer"
    return None


# Transports ----------------------------------------------------------------------------------
class SkipCopier:
    """A staging copier that copies nothing (benchmarks only: bytes are NOT moved between the KV cache
    and the pool). It times the staging pipeline alone (messages, slots, the pool-to-pool move) as if
    the gather and scatter took no CPU, which is what a GPU's copy engine approaches."""

    def copy(self, pairs: Any) -> None:
        """Nothing is copied."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


@dataclasses.dataclass(frozen=True)
class PeerSpec:
    """One transport over one KV cache.

    Transport: engine kind (any of kv_connectors.transports.KINDS; "memory" only in this process),
    its name, the engine knobs, and, where pool > 0, a StagedTransport of pool bytes in chunk-byte
    slots around it (liveness probe every probe_s). KV: a test profile filled from seed, or, where
    shape is set, the benchmark word pattern ("pattern") or sentinels ("sentinel") on device."""

    kind: str
    name: str
    seed: int = 1
    profile: str = "small"
    pool: int = 0
    chunk: int = 0
    probe_s: float = 0.5
    progress_delay_us: int = 1000
    num_threads: int | None = None
    max_batch: int = 1000
    protocol: str = "tcp"
    shape: Shape | None = None
    device: str = "cpu"
    fill: str = "pattern"
    idle: float | None = None  # seconds between progress steps while no command comes
    digest_notifs: bool = True  # take storage_digest() at each notification (tests; too slow for benchmarks)
    host: str = "127.0.0.1"  # this peer's address (Mooncake's hostname)
    netns: str = ""  # a network namespace (kvc_testing.netns) the peer process enters first
    copies: str = "real"  # staging: "skip" = a SkipCopier (the pipeline timed without its copies)

    @property
    def idle_s(self) -> float:
        """How long a peer process waits for a command between progress steps (a staging peer
        takes part in every chunk of its peers' transfers, so it progresses often)."""
        if self.idle is not None:
            return self.idle
        return 0.0005 if self.pool else 0.002 if self.kind == "mooncake" else 0.005

    @property
    def memory_kind(self) -> MemoryKind:
        return MemoryKind.DEVICE if self.device.startswith("cuda") else MemoryKind.HOST


def engine_config(spec: PeerSpec) -> ConnectorConfig:
    """The connector config create_transport reads the spec's engine knobs from."""
    return ConnectorConfig(
        engine_id=spec.name,
        role=Role.BOTH,
        progress_delay_us=spec.progress_delay_us,
        nixl_num_threads=spec.num_threads or 0,
        mooncake_protocol=spec.protocol,
        side_channel_host=spec.host,
    )


def open_transport(spec: PeerSpec, **kwargs: Any) -> Transport:
    """The spec's transport, not yet registered (kwargs go to the engine: the memory transport's fabric)."""
    if spec.kind == "mooncake":
        kwargs.setdefault("max_batch", spec.max_batch)
    inner = create_transport(spec.kind, spec.name, engine_config(spec), **kwargs)
    if not spec.pool:
        return inner
    from kv_connectors.transports.staging import StagedTransport

    try:
        copier = SkipCopier() if spec.copies == "skip" else None
        return StagedTransport(inner, pool_bytes=spec.pool, chunk_bytes=spec.chunk, probe_interval_s=spec.probe_s, copier=copier)
    except BaseException:
        inner.close()
        raise


def kv_of(spec: PeerSpec) -> tuple[list[Any], KVLayout]:
    """The spec's KV cache and its layout."""
    if spec.shape is not None:
        kv = bench_kv(spec.shape, spec.device, spec.fill)
        return kv, bench_layout(kv, spec.shape)
    storage = make_kv(spec.seed, spec.profile)
    return storage, layout_of(storage)


# The peer ------------------------------------------------------------------------------------
class Server:
    """A peer: one registered transport and its KV cache; each cmd_* answers one command."""

    def __init__(self, spec: PeerSpec, **kwargs: Any) -> None:
        self.spec = spec
        self.storage, self.layout = kv_of(spec)
        self.t = open_transport(spec, **kwargs)
        try:
            self.t.register(self.layout, spec.memory_kind, 0)
        except BaseException:
            self.t.close()
            raise
        self.notifs: list[tuple[str, bytes, str]] = []
        self.handles: list[Any] = []
        self.paused_until = 0.0
        self.closed = False

    def step(self) -> None:
        """Collect notifications and progress our own transfers, unless paused or closed."""
        if self.closed or time.monotonic() < self.paused_until:
            return
        got = self.t.get_notifs()
        if got:
            digest = storage_digest(self.storage) if self.spec.digest_notifs else ""
            self.notifs.extend((peer, msg, digest) for peer, msg in got)
        for h in list(self.handles):
            try:
                if self.t.poll(h) is XferState.DONE:
                    self.handles.remove(h)
                    self.t.release(h)
            except TransportError:
                self.handles.remove(h)
                self.t.release(h)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.t.close()

    def cmd_notifs(self) -> list[tuple[str, bytes, str]]:
        self.step()
        out, self.notifs = self.notifs, []
        return out

    def cmd_dump(self) -> list[np.ndarray]:
        return [a.copy() for a in self.storage]

    def cmd_stats(self) -> dict[str, int]:
        return self.t.pool_stats()  # type: ignore[attr-defined, no-any-return]

    def cmd_connect(self, name: str, metadata: bytes) -> str:
        self.t.connect(name, metadata)
        return "ok"

    def cmd_disconnect(self, name: str) -> str:
        self.t.disconnect(name)
        return "ok"

    def cmd_notify(self, name: str, msg: bytes) -> str:
        self.t.send_notif(name, msg)
        return "ok"

    def cmd_reset(self, seed: int) -> str:
        for a, b in zip(self.storage, make_kv(seed, self.spec.profile)):
            a[...] = b
        return "ok"

    def cmd_pause(self, seconds: float) -> str:
        self.paused_until = time.monotonic() + seconds
        return "ok"

    def cmd_read(self, peer: str, remote: KVLayout, src_ids: Sequence[int], dst_ids: Sequence[int], notif: bytes) -> str:
        self.handles.append(self.t.post_read(peer, plan_transfer(remote, src_ids, self.layout, dst_ids), notif))
        return "ok"

    def cmd_verify(self, src_ids: Any, dst_ids: Any) -> str:
        """Benchmark KV: "ok" if block dst_ids[i] holds the pattern of block src_ids[i], else what is wrong."""
        return check_pattern(self.storage, src_ids, dst_ids) or "ok"

    def answer(self, cmd: tuple[Any, ...]) -> Any:
        return getattr(self, f"cmd_{cmd[0]}")(*cmd[1:])


def serve(conn: Connection, spec: PeerSpec) -> None:
    """Peer process body: a Server over spec; reports ("ready", metadata, layout), then progresses
    every spec.idle_s and answers commands (tuples) on conn until ("stop",) or a closed pipe.

    ("notifs",) -> (peer, msg, digest) triples received so far (then cleared): digest is
    storage_digest() taken as soon as the notification was seen (spec.digest_notifs), so a test can
    tell whether the data had landed before it; ("dump",) -> the storage arrays; ("stats",) ->
    pool_stats() (staging); ("connect", name, md) / ("disconnect", name) -> "ok"; ("notify", name,
    msg) -> "ok" once sent; ("reset", seed) -> "ok" (refill); ("pause", s) -> "ok", then no progress
    for s seconds; ("read", peer, remote_layout, src_ids, dst_ids, notif) -> "ok", a pull from peer
    progressed in the loop; ("verify", src_ids, dst_ids) -> "ok" or what is wrong (benchmark KV);
    ("stop",) -> close, "bye". A command that raises answers ("error", repr).
    """
    if spec.netns:
        from kvc_testing import netns

        netns.enter(spec.netns)  # before any engine starts a thread or opens a socket
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback between the processes
    server = None
    try:
        server = Server(spec)
        conn.send(("ready", server.t.local_metadata(), server.layout))
        while True:
            server.step()
            if not conn.poll(spec.idle_s):
                continue
            cmd = conn.recv()
            if cmd[0] == "stop":
                server.close()
                conn.send("bye")
                return
            try:
                conn.send(server.answer(cmd))
            except TransportError as e:
                conn.send(("error", repr(e)))
    except (EOFError, BrokenPipeError):
        pass  # the driving process went away: just exit
    finally:
        if server is not None:
            server.close()


# Driving peers -------------------------------------------------------------------------------
class _Waits:
    """Waits shared by process and in-process peers (both answer call())."""

    name: str
    wait_s: float
    inbox: list[tuple[str, bytes, str]]

    def call(self, *cmd: Any, timeout: float | None = None) -> Any:
        raise NotImplementedError

    def wait_notif(self, sender: str, msg: bytes, timeout: float | None = None, on_wait: Callable[[], None] | None = None) -> str:
        """Wait for one notification; returns the peer's storage digest taken when it arrived.
        on_wait runs between checks (progress the caller's own transport there)."""
        timeout = self.wait_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.inbox += self.call("notifs")
            for item in self.inbox:
                if item[:2] == (sender, msg):
                    self.inbox.remove(item)
                    return item[2]
            if on_wait is not None:
                on_wait()
            time.sleep(0.001)
        raise AssertionError(f"peer {self.name} did not get notif {(sender, msg)} within {timeout} s (got {self.inbox})")

    def wait_idle(self, timeout: float | None = None) -> dict[str, int]:
        """A staging peer's pool stats once it holds no slot."""
        deadline = time.monotonic() + (self.wait_s if timeout is None else timeout)
        while True:
            stats = self.call("stats")
            if stats["slots_in_use"] == 0 and stats["queued"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"peer {self.name} still holds slots: {stats}")
            time.sleep(0.01)


@dataclasses.dataclass
class Peer(_Waits):
    """A peer process (serve) and its pipe; wait_s is the default deadline of its waits."""

    name: str
    seed: int
    proc: Any
    conn: Connection
    wait_s: float
    metadata: bytes = b""
    layout: KVLayout | None = None
    inbox: list[tuple[str, bytes, str]] = dataclasses.field(default_factory=list)

    def call(self, *cmd: Any, timeout: float | None = None) -> Any:
        timeout = self.wait_s if timeout is None else timeout
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.name} did not answer {cmd[0]} within {timeout} s")
        return self.conn.recv()

    @property
    def alive(self) -> bool:
        return bool(self.proc.is_alive())

    def step(self) -> None:
        """A peer process progresses on its own."""

    def kill(self) -> None:
        """SIGKILL: the peer disappears without a word."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(self.wait_s)
        assert not self.proc.is_alive()


@dataclasses.dataclass
class InProcessPeer(_Waits):
    """A Server in this process (the memory transport), driven like a Peer: progressed at each call
    and at each step() (the caller's wait loops call it)."""

    name: str
    seed: int
    server: Server
    wait_s: float
    metadata: bytes = b""
    layout: KVLayout | None = None
    inbox: list[tuple[str, bytes, str]] = dataclasses.field(default_factory=list)

    def call(self, *cmd: Any, timeout: float | None = None) -> Any:
        if cmd[0] == "stop":
            self.server.close()
            return "bye"
        if self.server.closed:
            raise TimeoutError(f"peer {self.name} is closed")
        self.server.step()
        try:
            return self.server.answer(cmd)
        except TransportError as e:
            return ("error", repr(e))

    @property
    def alive(self) -> bool:
        return not self.server.closed

    def step(self) -> None:
        self.server.step()

    def kill(self) -> None:
        """The peer closes its transport (and is gone from the fabric)."""
        self.server.close()


def start_in_process(spec: PeerSpec, wait_s: float, **kwargs: Any) -> InProcessPeer:
    server = Server(spec, **kwargs)
    return InProcessPeer(spec.name, spec.seed, server, wait_s, server.t.local_metadata(), server.layout)


def start_peers(specs: Sequence[PeerSpec], wait_s: float, startup_s: float = STARTUP_S) -> list[Peer]:
    """Start peer processes in parallel and wait until each is ready; the caller stops them with
    stop_peers (on a failed start, those already started are stopped here)."""
    peers: list[Peer] = []
    try:
        for spec in specs:
            parent, child = _CTX.Pipe()
            proc = _CTX.Process(target=serve, args=(child, spec), daemon=True)
            proc.start()
            child.close()
            peers.append(Peer(spec.name, spec.seed, proc, parent, wait_s))
        for p in peers:
            if not p.conn.poll(startup_s):
                raise TimeoutError(f"peer {p.name} did not start within {startup_s} s")
            tag, p.metadata, p.layout = p.conn.recv()
            assert tag == "ready"
    except BaseException:
        stop_peers(peers)
        raise
    return peers


def stop_peers(peers: Sequence[Peer | InProcessPeer]) -> None:
    for p in peers:
        if isinstance(p, InProcessPeer):
            p.call("stop")
            continue
        if p.proc.is_alive():
            try:
                p.call("stop", timeout=STOP_S)
            except (TimeoutError, OSError, EOFError):
                pass
        p.proc.join(STOP_S)
        if p.proc.is_alive():
            p.proc.kill()
            p.proc.join(STOP_S)
        p.conn.close()


@contextlib.contextmanager
def peer_starter(kind: str, wait_s: float) -> Iterator[Callable[..., Peer]]:
    """start(name="p", seed=1, profile="small") -> a ready peer process; all are stopped on exit."""
    peers: list[Peer] = []

    def start(name: str = "p", seed: int = 1, profile: str = "small") -> Peer:
        p = start_peers([PeerSpec(kind, name, seed, profile)], wait_s)[0]
        peers.append(p)
        return p

    try:
        yield start
    finally:
        stop_peers(peers)


loopback_env = ucx_on_loopback  # UCX on loopback (spawned peers inherit it); a value already set is kept


# The caller's own transport ------------------------------------------------------------------
@dataclasses.dataclass
class Local:
    """The caller's transport over its own patterned KV cache, and the peers connected to it."""

    transport: Any
    storage: list[np.ndarray]
    layout: KVLayout
    peers: list[Peer | InProcessPeer] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        """Peers forget us first (staging peers talk back), then our transport closes."""
        for p in self.peers:
            if p.alive:
                try:
                    p.call("disconnect", self.transport.name, timeout=STOP_S)
                except (TimeoutError, OSError, EOFError):
                    pass
        self.transport.close()


def open_local(spec: PeerSpec, peers: Sequence[Peer | InProcessPeer] = (), **kwargs: Any) -> Local:
    """spec's transport over a fresh KV cache, registered, connected both ways with every peer."""
    storage, layout = kv_of(spec)
    t = open_transport(spec, **kwargs)
    try:
        t.register(layout, spec.memory_kind, 0)
        for p in peers:
            t.connect(p.name, p.metadata)
            assert p.call("connect", t.name, t.local_metadata()) == "ok"
    except BaseException:
        t.close()
        raise
    return Local(t, storage, layout, list(peers))
