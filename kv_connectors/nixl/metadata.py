"""What a NIXL peer's handshake carries: NIXL's own agent metadata plus where its registered memory lives."""

from __future__ import annotations

import msgspec

from kv_connectors.errors import TransportError

# local_metadata() = magic + msgpack(AgentInfo); bytes without the magic are taken as raw NIXL
# agent metadata of a host-memory peer (e.g. produced by another NIXL user).
MD_MAGIC = b"KVCNIXL1"


class AgentInfo(msgspec.Struct, array_like=True, frozen=True):
    """What a peer needs besides NIXL's own metadata: where our registered memory lives."""

    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    nixl_md: bytes


def encode_metadata(info: AgentInfo) -> bytes:
    return MD_MAGIC + msgspec.msgpack.encode(info)


def decode_metadata(data: bytes) -> AgentInfo:
    if not data.startswith(MD_MAGIC):
        return AgentInfo("DRAM", 0, bytes(data))
    try:
        return msgspec.msgpack.decode(data[len(MD_MAGIC) :], type=AgentInfo)
    except msgspec.DecodeError as e:
        raise TransportError(f"malformed NIXL peer metadata: {e}") from e
