"""Test helper: a patterned KV cache and a NIXL peer process serving it, driven over a multiprocessing pipe."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from multiprocessing.connection import Connection

import numpy as np

from kv_connectors.layout import KVLayout, TensorInfo, build_layout

logger = logging.getLogger(__name__)

SMALL_BLOCKS = 32  # "small": five regions, packed and padded ones, 512-byte segments
BIG_BLOCKS = 8192  # "big": one region of 4 KiB blocks, 32 MiB (long enough to be killed mid-read)
_PAD_COLS = 160  # padded tensor: 128 words of segment + 32 of padding per block


def make_kv(seed: int, profile: str = "small") -> list[np.ndarray]:
    """Storage arrays (uint32, compared byte for byte) filled with a pattern unique to seed."""
    rng = np.random.default_rng(seed)
    if profile == "small":
        nb = SMALL_BLOCKS
        shapes: list[tuple[int, ...]] = [(nb, 2, 4, 16), (nb, 2, 4, 16), (2, nb, 4, 2, 8), (nb, _PAD_COLS)]
    elif profile == "big":
        shapes = [(BIG_BLOCKS, 1024)]
    else:
        raise ValueError(f"unknown KV profile {profile!r}")
    return [rng.integers(0, 2**32, size=s, dtype=np.uint32) for s in shapes]


def num_blocks(storage: Sequence[np.ndarray]) -> int:
    return BIG_BLOCKS if len(storage) == 1 else SMALL_BLOCKS


def kv_views(storage: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The KV tensors of the layout; the padded tensor is a strided view of its storage."""
    if len(storage) == 1:
        return list(storage)
    a, b, c, d = storage
    return [a, b, c, d[:, :128]]


def layout_of(storage: Sequence[np.ndarray]) -> KVLayout:
    infos = [
        TensorInfo(
            name=f"t{i}",
            data_ptr=v.ctypes.data,
            shape=tuple(v.shape),
            stride=tuple(s // v.itemsize for s in v.strides),
            element_size=v.itemsize,
        )
        for i, v in enumerate(kv_views(storage))
    ]
    return build_layout(infos, num_blocks(storage), block_size=4)


def block_copy(
    dst: Sequence[np.ndarray], src: Sequence[np.ndarray], src_ids: Sequence[int], dst_ids: Sequence[int]
) -> None:
    """Reference copy (in place on dst): what a transfer of src_ids -> dst_ids must produce."""
    s, d = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    if len(dst) == 1:
        dst[0][d] = src[0][s]
        return
    dst[0][d] = src[0][s]
    dst[1][d] = src[1][s]
    dst[2][:, d] = src[2][:, s]
    dst[3][d, :128] = src[3][s, :128]  # padding is not part of the KV and must stay untouched


def serve(conn: Connection, name: str, seed: int, profile: str = "small", progress_delay_us: int = 1000) -> None:
    """Peer process body: register a patterned KV cache, report metadata, collect notifications.

    Commands (tuples) on conn: ("notifs",) -> list of (peer, msg) received so far (then cleared);
    ("dump",) -> the storage arrays; ("stop",) -> close the transport, answer "bye", exit.
    """
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from kv_connectors.nixl.transport import NixlTransport

    storage = make_kv(seed, profile)
    transport = NixlTransport(name, progress_delay_us=progress_delay_us)
    layout = layout_of(storage)
    transport.register(layout)
    conn.send(("ready", transport.local_metadata(), layout))
    notifs: list[tuple[str, bytes]] = []
    try:
        while True:
            notifs.extend(transport.get_notifs())
            if not conn.poll(0.005):
                continue
            cmd = conn.recv()[0]
            if cmd == "notifs":
                notifs.extend(transport.get_notifs())
                conn.send(list(notifs))
                notifs.clear()
            elif cmd == "dump":
                conn.send([a.copy() for a in storage])
            elif cmd == "stop":
                transport.close()
                conn.send("bye")
                break
    except (EOFError, BrokenPipeError):
        pass  # the test process went away: just exit
    finally:
        transport.close()


def storage_digest(storage: Sequence[np.ndarray]) -> str:
    """SHA-256 of all storage bytes, in order (what a peer had when a notification arrived)."""
    h = hashlib.sha256()
    for a in storage:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def serve_mooncake(conn: Connection, name: str, seed: int, profile: str = "small", max_batch: int = 1000) -> None:
    """Peer process body for a MooncakeTransport; same commands as serve().

    ("notifs",) answers (peer, msg, digest) triples: digest is storage_digest() taken as soon as
    the notification was seen, so a test can tell whether the data had landed before it.
    """
    from kv_connectors.mooncake.transport import MooncakeTransport

    storage = make_kv(seed, profile)
    transport = MooncakeTransport(name, max_batch=max_batch)
    layout = layout_of(storage)
    transport.register(layout)
    conn.send(("ready", transport.local_metadata(), layout))
    notifs: list[tuple[str, bytes, str]] = []

    def collect() -> None:
        got = transport.get_notifs()
        if got:
            digest = storage_digest(storage)
            notifs.extend((peer, msg, digest) for peer, msg in got)

    try:
        while True:
            collect()
            if not conn.poll(0.002):
                continue
            cmd = conn.recv()[0]
            if cmd == "notifs":
                collect()
                conn.send(list(notifs))
                notifs.clear()
            elif cmd == "dump":
                conn.send([a.copy() for a in storage])
            elif cmd == "stop":
                transport.close()
                conn.send("bye")
                break
    except (EOFError, BrokenPipeError):
        pass  # the test process went away: just exit
    finally:
        transport.close()
