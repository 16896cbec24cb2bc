"""What two peers must agree on to exchange KV blocks (hashed into every frame's header), and the wire version."""

from __future__ import annotations

import hashlib

import msgspec

# Wire history: 1 = handshake, push, notifications; 2 = claims (the fence), renewals, epochs, MACs;
# 3 = Mooncake transport metadata carries the registered ranges, the error code set is closed;
# 4 = push requests name their attempt and D's budget, D aborts a push and P confirms it settled.
# A peer of another version is refused at the handshake with "upgrade both sides".
WIRE_VERSION = 4


class CompatInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What two peers must agree on to exchange KV blocks; hashed into the compatibility hash."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    dtype: str
    block_size: int  # 0 where the layout's cells let the planner map tokens between block sizes
    layout: tuple[int, ...]  # KVLayout.compat_signature()
    transport: str = ""  # e.g. "nixl" or "mooncake+staging": peers must move data the same way
    wire_version: int = WIRE_VERSION
    # A hybrid model's KV cache groups, (kind, window, block size, layers) each (CacheGroups.signature);
    # () for one group, which the hash leaves out: a one-group peer hashes as before groups existed.
    groups: tuple[tuple[str, int, int, int], ...] = ()

    def hash(self) -> str:
        fields = msgspec.structs.asdict(self)
        if not self.groups:
            del fields["groups"]
        return hashlib.sha256(msgspec.msgpack.encode(fields)).hexdigest()[:32]

    def diff(self, other: CompatInfo, mine: str = "ours", theirs: str = "peer") -> str:
        """Human-readable list of the fields that differ (for error messages); KV cache groups field by field."""
        parts = [
            f"{f}: {mine}={getattr(self, f)!r} {theirs}={getattr(other, f)!r}"
            for f in self.__struct_fields__
            if f != "groups" and getattr(self, f) != getattr(other, f)
        ]
        if self.groups != other.groups:
            parts.append(_groups_diff(self.groups, other.groups, mine, theirs))
        return "; ".join(parts) or "no field differs"


_GROUP_FIELDS = ("kind", "window", "block_size", "layers")


def _groups_diff(a: tuple[tuple[str, int, int, int], ...], b: tuple[tuple[str, int, int, int], ...], mine: str, theirs: str) -> str:
    """KV cache groups that differ: their number, else each group's differing fields (one group: none stated)."""
    if len(a) != len(b):
        return f"KV cache groups: {mine}={max(len(a), 1)} {theirs}={max(len(b), 1)}"
    return ", ".join(
        f"KV cache group {i} {name}: {mine}={x!r} {theirs}={y!r}"
        for i, (ga, gb) in enumerate(zip(a, b))
        for name, x, y in zip(_GROUP_FIELDS, ga, gb)
        if x != y
    )
