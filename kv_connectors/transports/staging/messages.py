"""Wire format of the staging protocol: pool metadata, tagged messages and their packing helpers."""

from __future__ import annotations

import msgspec
import numpy as np

from kv_connectors.errors import PeerDisconnectedError, TransferTimeoutError, TransportError

MSG_MAGIC = b"\x00KVCSTG1"  # staging notifications (msgpack lists of messages) start with this
MD_MAGIC = b"KVCSTGM1"  # local_metadata() = magic + msgpack(StagedInfo)
ERROR_KINDS: tuple[type[TransportError], ...] = (TransportError, PeerDisconnectedError, TransferTimeoutError)


class StagedInfo(msgspec.Struct, array_like=True, frozen=True):
    """What a peer needs besides the inner transport's metadata: where our pool is."""

    inner: bytes
    pool_base: int
    pool_bytes: int
    chunk_bytes: int
    max_runs: int
    kv_direct: bool = False  # the peer's KV is registered with its inner transport too (fragmented staging)


class Msg(msgspec.Struct, array_like=True, frozen=True):
    """A staging message; `xfer` is the initiator's transfer id, `chunk` the chunk index."""


class Stage(Msg, tag=1):  # D -> P: gather these runs of your KV cache into a slot
    xfer: int
    chunk: int
    runs: bytes  # int64 (addr, length) pairs


class Ready(Msg, tag=2):  # P -> D: the chunk is at offset in my pool
    xfer: int
    chunk: int
    offset: int


class Free(Msg, tag=3):  # initiator -> responder: release the slot you hold for this chunk
    xfer: int
    chunk: int
    offset: int


class Want(Msg, tag=4):  # P -> D: give me a slot for nbytes
    xfer: int
    chunk: int
    nbytes: int


class Slot(Msg, tag=5):  # D -> P: write it at offset in my pool
    xfer: int
    chunk: int
    offset: int


class Scatter(Msg, tag=6):  # P -> D, carried by the inner WRITE: scatter the slot into these runs
    xfer: int
    chunk: int
    offset: int
    runs: bytes


class Scattered(Msg, tag=7):  # D -> P: the chunk is in my KV cache, my slot is free
    xfer: int
    chunk: int


class Error(Msg, tag=8):  # either way: the transfer failed; to_initiator tells which side's id it is
    xfer: int
    to_initiator: bool
    kind: int  # index into ERROR_KINDS
    reason: str


class User(Msg, tag=9):  # a user notification that itself starts with MSG_MAGIC (escaped)
    payload: bytes


ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(list[Stage | Ready | Free | Want | Slot | Scatter | Scattered | Error | User])


def pack_runs(addr: np.ndarray, length: np.ndarray) -> bytes:
    return np.stack([addr, length], axis=1).astype("<i8").tobytes()


def unpack_runs(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    if len(data) % 16:
        raise TransportError(f"malformed run list ({len(data)} bytes)")
    runs = np.frombuffer(data, dtype="<i8").reshape(-1, 2).astype(np.int64)
    return runs[:, 0], runs[:, 1]


def user_bytes(msg: bytes) -> bytes:
    return MSG_MAGIC + ENC.encode([User(bytes(msg))]) if msg.startswith(MSG_MAGIC) else bytes(msg)


def error_kind(err: TransportError) -> int:
    """Index of the error's most specific class in ERROR_KINDS (sent in Error)."""
    return max((i for i, cls in enumerate(ERROR_KINDS) if isinstance(err, cls)), default=0)
