"""What reaches a Mooncake peer besides the engine's bytes: the handshake's metadata and our notifications' text."""

from __future__ import annotations

import base64

import msgspec

from kv_connectors.errors import TransportError

MD_MAGIC = b"KVCMOON1"  # local_metadata() = magic + msgpack(PeerInfo)
NOTIF_PREFIX = "kvc1:"  # notify payloads are str in Mooncake: ours are base64 behind this prefix


class PeerInfo(msgspec.Struct, array_like=True, frozen=True):
    """What a peer needs to reach us: the engine's session id, a registered scratch byte, and the
    (start, end) ranges registered at the time (a peer checks its plans against them before posting:
    the engine would refuse only the runs outside, and move the rest of the batch)."""

    session_id: str  # "host:rpc_port"
    scratch_addr: int
    ranges: list[tuple[int, int]] = []


def encode_metadata(info: PeerInfo) -> bytes:
    return MD_MAGIC + msgspec.msgpack.encode(info)


def decode_metadata(data: bytes) -> PeerInfo:
    if not data.startswith(MD_MAGIC):
        raise TransportError("peer metadata is not from a kv-connectors Mooncake transport")
    try:
        return msgspec.msgpack.decode(data[len(MD_MAGIC) :], type=PeerInfo)
    except msgspec.DecodeError as e:
        raise TransportError(f"malformed Mooncake peer metadata: {e}") from e


def encode_notif(msg: bytes) -> str:
    return NOTIF_PREFIX + base64.b64encode(bytes(msg)).decode("ascii")


def decode_notif(text: str) -> bytes:
    """Our notification's bytes; a foreign sender's plain string as its UTF-8 (ValueError: malformed)."""
    if text.startswith(NOTIF_PREFIX):
        return base64.b64decode(text[len(NOTIF_PREFIX) :])
    return text.encode("utf-8", "surrogateescape")  # a foreign sender's plain string
