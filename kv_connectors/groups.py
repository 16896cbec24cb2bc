"""A model's KV cache groups (vLLM's hybrid memory allocator) and a request's blocks in each, pure.

A hybrid model (Gemma 3, gpt-oss: sliding-window layers beside full-attention ones) has one block
table per group, all drawn from one pool: a block id belongs to one group at a time, and the groups'
layers overlay the same memory (a layer of each group shares one backing tensor). So moving block b
through every registered tensor moves exactly the KV of the group that owns b, and a request's
transfer is its groups' block lists side by side ("flat", in group order), paired group by group.

A sliding-window group holds only the blocks inside its window at the prompt's end: vLLM gives the
null block (id 0) for the positions before it, and neither side ever reads or writes those."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from kv_connectors.errors import TransferParamsError

NULL_BLOCK = 0  # vLLM's null block: a placeholder in a group's table, never a block to move
MAX_GROUPS = 16  # what a peer's params may name; the hybrids vLLM serves have 2-4


class GroupKind(str, enum.Enum):
    """The kinds of KV cache group moved (anything else stops the instance at start-up)."""

    FULL = "full_attention"
    SLIDING = "sliding_window"


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """One KV cache group: its kind, layers, tokens per block and (sliding window) window in tokens."""

    kind: GroupKind
    layers: tuple[str, ...]
    block_size: int
    window: int = 0

    def signature(self) -> tuple[str, int, int, int]:
        """What peers must share of it (the compatibility hash): kind, window, block size, layer count."""
        return (self.kind.value, self.window, self.block_size, len(self.layers))


@dataclasses.dataclass(frozen=True)
class CacheGroups:
    """A model's KV cache groups, in vLLM's order (a request's block lists come in this order)."""

    groups: tuple[CacheGroup, ...]

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def signature(self) -> tuple[tuple[str, int, int, int], ...]:
        """() for one group (the compatibility hash then stays what it was without groups)."""
        return tuple(g.signature() for g in self.groups) if self.hybrid else ()

    def held(self, per_group: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """P's blocks of a finished prefill that hold KV: a sliding-window group's table without the
        null blocks vLLM put before its window (a full group's whole)."""
        if len(per_group) != len(self.groups):
            raise ValueError(f"{len(per_group)} block lists for {len(self.groups)} KV cache groups")
        return tuple(
            tuple(b for b in ids if b != NULL_BLOCK) if g.kind is GroupKind.SLIDING else tuple(ids)
            for g, ids in zip(self.groups, per_group)
        )


def flatten(per_group: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(every group's blocks in group order, each group's count)."""
    return tuple(b for ids in per_group for b in ids), tuple(len(ids) for ids in per_group)


def split(flat: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """flatten's inverse; sizes () is one group."""
    if not sizes:
        return [tuple(flat)]
    if sum(sizes) != len(flat):
        raise TransferParamsError(f"{len(flat)} blocks do not split into groups of {list(sizes)}")
    out, start = [], 0
    for n in sizes:
        out.append(tuple(flat[start : start + n]))
        start += n
    return out


def pair_tails(
    local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """D's blocks to load in each group, paired with P's from the tail (both lists end at the prompt's
    last block; D's earlier ones are its own prefix-cache hits or, in a sliding window, null):
    (local flat, remote flat, sizes). A group where P holds fewer blocks than D must load (its window
    dropped them) is a TransferParamsError naming it: loading less would leave D attending to blocks
    nobody wrote."""
    if len(local) != len(remote):
        raise TransferParamsError(f"the prefill stated {len(remote)} KV cache groups, this model has {len(local)}")
    remote_tails = []
    for g, (mine, theirs) in enumerate(zip(local, remote)):
        if len(theirs) < len(mine):
            raise TransferParamsError(
                f"KV cache group {g}: the prefill holds {len(theirs)} blocks, the decode needs {len(mine)} "
                "(the prefill's sliding window no longer holds the rest)"
            )
        remote_tails.append(tuple(theirs[len(theirs) - len(mine) :]) if mine else ())
    local_flat, sizes = flatten(local)
    return local_flat, flatten(remote_tails)[0], sizes
