"""Test peer: patterned KV caches and the one peer-process body (any transport, staged or not), driven over a pipe."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kv_connectors.errors import TransportError
from kv_connectors.layout import KVLayout, TensorInfo, build_layout
from kv_connectors.plan import plan_transfer
from kv_connectors.transports.base import Transport, XferState

logger = logging.getLogger(__name__)


# KV caches -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Profile:
    """A KV cache of uint32 storage arrays (compared byte for byte). Array i has its blocks on
    dimension block_dims[i]; where kv_cols[i] is set, only the first kv_cols[i] words of a block
    are KV (the rest is padding that must stay untouched)."""

    num_blocks: int
    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    block_dims: tuple[int, ...]
    kv_cols: tuple[int | None, ...]


SMALL_BLOCKS = 32  # "small": five regions, packed and padded ones, 512-byte segments
BIG_BLOCKS = 8192  # "big": one region of 4 KiB blocks, 32 MiB (long enough to be killed mid-read)
STAGED_BLOCKS = 320  # "staged": 16 KiB blocks over 4 regions (packed, K/V-split packed, padded)
PROFILES = {
    "small": Profile(
        SMALL_BLOCKS, 4, ((32, 2, 4, 16), (32, 2, 4, 16), (2, 32, 4, 2, 8), (32, 160)), (0, 0, 1, 0), (None, None, None, 128)
    ),
    "big": Profile(BIG_BLOCKS, 4, ((BIG_BLOCKS, 1024),), (0,), (None,)),
    "staged": Profile(STAGED_BLOCKS, 16, ((320, 2, 8, 64), (2, 320, 1024), (320, 1024 + 64)), (0, 1, 0), (None, None, 1024)),
}


def make_kv(seed: int, profile: str = "small") -> list[np.ndarray]:
    """Storage arrays filled with a pattern unique to seed."""
    if profile not in PROFILES:
        raise ValueError(f"unknown KV profile {profile!r}")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**32, size=s, dtype=np.uint32) for s in PROFILES[profile].shapes]


def profile_of(storage: Sequence[Any]) -> Profile:
    shapes = tuple(tuple(a.shape) for a in storage)
    for prof in PROFILES.values():
        if prof.shapes == shapes:
            return prof
    raise ValueError(f"storage of shapes {shapes} matches no KV profile")


def kv_views(storage: Sequence[Any]) -> list[Any]:
    """The KV tensors of the layout (numpy or torch); a padded tensor is a strided view of its storage."""
    return [a if cols is None else a[:, :cols] for a, cols in zip(storage, profile_of(storage).kv_cols)]


def layout_of(storage: Sequence[Any]) -> KVLayout:
    """The layout of a profile's storage arrays, numpy (host) or torch (any device)."""
    infos = []
    for i, v in enumerate(kv_views(storage)):
        if isinstance(v, np.ndarray):
            ptr, stride, size = v.ctypes.data, tuple(s // v.itemsize for s in v.strides), v.itemsize
        else:
            ptr, stride, size = v.data_ptr(), tuple(v.stride()), v.element_size()
        infos.append(TensorInfo(f"t{i}", ptr, tuple(v.shape), stride, size))
    prof = profile_of(storage)
    return build_layout(infos, prof.num_blocks, block_size=prof.block_size)


def block_copy(dst: Sequence[np.ndarray], src: Sequence[np.ndarray], src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    """Reference copy (in place on dst): what a transfer of src_ids -> dst_ids must produce."""
    s, d = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    prof = profile_of(dst)
    for i, (dim, cols) in enumerate(zip(prof.block_dims, prof.kv_cols)):
        tail = () if cols is None else (slice(0, cols),)  # padding is not part of the KV
        dst[i][(slice(None),) * dim + (d,) + tail] = src[i][(slice(None),) * dim + (s,) + tail]


def storage_digest(storage: Sequence[np.ndarray]) -> str:
    """SHA-256 of all storage bytes, in order (what a peer had when a notification arrived)."""
    h = hashlib.sha256()
    for a in storage:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# Transports ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PeerSpec:
    """One transport over one KV cache: engine kind ("nixl" or "mooncake"), its name, the KV
    pattern, and, where pool > 0, a StagedTransport of pool bytes in chunk-byte slots around it."""

    kind: str
    name: str
    seed: int = 1
    profile: str = "small"
    pool: int = 0
    chunk: int = 0

    @property
    def idle_s(self) -> float:
        """How long a peer process waits for a command between progress steps (a staging peer
        takes part in every chunk of its peers' transfers, so it progresses often)."""
        return 0.0005 if self.pool else 0.002 if self.kind == "mooncake" else 0.005


def open_transport(spec: PeerSpec) -> Transport:
    """The spec's transport, not yet registered."""
    inner: Transport
    if spec.kind == "nixl":
        from kv_connectors.transports.nixl import NixlTransport

        inner = NixlTransport(spec.name)
    elif spec.kind == "mooncake":
        from kv_connectors.transports.mooncake import MooncakeTransport

        inner = MooncakeTransport(spec.name)
    else:
        raise ValueError(f"unknown transport kind {spec.kind!r}")
    if not spec.pool:
        return inner
    from kv_connectors.transports.staging import StagedTransport

    return StagedTransport(inner, pool_bytes=spec.pool, chunk_bytes=spec.chunk, probe_interval_s=0.5)


# Peer process --------------------------------------------------------------------------------
class _Server:
    """What a peer process keeps between commands; each cmd_* answers one command."""

    def __init__(self, t: Any, storage: list[np.ndarray], layout: KVLayout, profile: str) -> None:
        self.t, self.storage, self.layout, self.profile = t, storage, layout, profile
        self.notifs: list[tuple[str, bytes, str]] = []
        self.handles: list[Any] = []
        self.paused_until = 0.0

    def step(self) -> None:
        """Collect notifications and progress our own reads, unless paused."""
        if time.monotonic() < self.paused_until:
            return
        got = self.t.get_notifs()
        if got:
            digest = storage_digest(self.storage)
            self.notifs.extend((peer, msg, digest) for peer, msg in got)
        for h in list(self.handles):
            try:
                if self.t.poll(h) is XferState.DONE:
                    self.handles.remove(h)
            except TransportError:
                self.handles.remove(h)

    def cmd_notifs(self) -> list[tuple[str, bytes, str]]:
        self.step()
        out, self.notifs = self.notifs, []
        return out

    def cmd_dump(self) -> list[np.ndarray]:
        return [a.copy() for a in self.storage]

    def cmd_stats(self) -> dict[str, int]:
        return self.t.pool_stats()

    def cmd_connect(self, name: str, metadata: bytes) -> str:
        self.t.connect(name, metadata)
        return "ok"

    def cmd_disconnect(self, name: str) -> str:
        self.t.disconnect(name)
        return "ok"

    def cmd_reset(self, seed: int) -> str:
        for a, b in zip(self.storage, make_kv(seed, self.profile)):
            a[...] = b
        return "ok"

    def cmd_pause(self, seconds: float) -> str:
        self.paused_until = time.monotonic() + seconds
        return "ok"

    def cmd_read(self, peer: str, remote: KVLayout, src_ids: Sequence[int], dst_ids: Sequence[int], notif: bytes) -> str:
        self.handles.append(self.t.post_read(peer, plan_transfer(remote, src_ids, self.layout, dst_ids), notif))
        return "ok"


def serve(conn: Connection, spec: PeerSpec) -> None:
    """Peer process body: register a patterned KV cache, report ("ready", metadata, layout), then
    progress every spec.idle_s and answer commands (tuples) on conn until ("stop",) or a closed pipe.

    ("notifs",) -> (peer, msg, digest) triples received so far (then cleared): digest is
    storage_digest() taken as soon as the notification was seen, so a test can tell whether the
    data had landed before it; ("dump",) -> the storage arrays; ("stats",) -> pool_stats() (staging);
    ("connect", name, md) / ("disconnect", name) -> "ok"; ("reset", seed) -> "ok" (refill);
    ("pause", s) -> "ok", then no progress for s seconds; ("read", peer, remote_layout, src_ids,
    dst_ids, notif) -> "ok", a pull from peer progressed in the loop; ("stop",) -> close, "bye".
    """
    if spec.kind == "nixl":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    storage = make_kv(spec.seed, spec.profile)
    t = open_transport(spec)
    try:
        layout = layout_of(storage)
        t.register(layout)
        conn.send(("ready", t.local_metadata(), layout))
        server = _Server(t, storage, layout, spec.profile)
        while True:
            server.step()
            if not conn.poll(spec.idle_s):
                continue
            cmd = conn.recv()
            if cmd[0] == "stop":
                t.close()
                conn.send("bye")
                return
            conn.send(getattr(server, f"cmd_{cmd[0]}")(*cmd[1:]))
    except (EOFError, BrokenPipeError):
        pass  # the test process went away: just exit
    finally:
        t.close()
