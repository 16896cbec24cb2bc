"""Lease words: the fence's one-sided path, a word per KV block in registered host memory.

P keeps one 64-bit word per block of its KV cache. While a lease holds a block, the block's word
is the lease's word (`lease_word(P's epoch, lease key)`); when the lease ends the word is cleared,
before the lease's request is reported finished (and so before vLLM can free the block and another
prompt overwrite it). A D that finished reading P's blocks then reads their words (a second,
one-sided read of a few bytes, posted only once the data read is complete): if every word still
equals the lease's, the lease had not ended when the words were read, so every byte of the data
read, which began after P answered the prefill, is the prompt's KV. Any other value (the lease
not added yet, ended, or a block shared with a later lease) proves nothing, and D falls back to
claiming the lease over the side channel (`kv_connectors.consumer.pull`).

D reads the words into a scratch array of its own, one word per block of D's cache, each at the
D block its P block is paired with (a D block belongs to one load at a time), so a load's words
read is planned like its data read: `plan_blocks` on two one-region layouts.

Host memory only: with the KV cache in device memory, or staged through a pool alone (staging "on"),
the fence claims as before. With staging "fragmented" the words are registered like the KV, and their
read goes directly or through the pool as its plan's shape says.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import numpy as np

from kv_connectors.layout import KVLayout, Region

WORD_BYTES = 8


def lease_word(epoch: str, key: str) -> int:
    """The word a lease under key writes on its blocks at the P process started as epoch (never 0)."""
    digest = hashlib.blake2b(f"{epoch}\0{key}".encode(), digest_size=WORD_BYTES).digest()
    return int.from_bytes(digest, "little") or 1


def words_layout(base: int, num_blocks: int) -> KVLayout:
    """A words array at base, one word per block, as a layout the planner and transports take."""
    return KVLayout(num_blocks, 1, (Region(base, WORD_BYTES, WORD_BYTES, num_blocks),))


class LeaseWords:
    """One word per KV block (zero: no lease), in memory a transport registers.

    P marks and clears words under its leases' lock (`state.SendLeases`); D reads its scratch
    copy on the engine thread. The lock orders a mark and a clear of shared blocks."""

    def __init__(self, num_blocks: int) -> None:
        self._words = np.zeros(max(1, num_blocks), dtype=np.uint64)
        self._lock = threading.Lock()
        self.layout = words_layout(int(self._words.ctypes.data), num_blocks)

    @property
    def base(self) -> int:
        return self.layout.regions[0].base

    def mark(self, word: int, block_ids: Sequence[int]) -> None:
        """A lease now holds these blocks: their words become its word."""
        if block_ids:
            with self._lock:
                self._words[np.asarray(block_ids, dtype=np.int64)] = np.uint64(word)

    def clear(self, word: int, block_ids: Sequence[int]) -> None:
        """The lease with this word ended: clear the words still its own (a block a later lease
        shares keeps that lease's word)."""
        if block_ids:
            ids = np.asarray(block_ids, dtype=np.int64)
            with self._lock:
                mine = ids[self._words[ids] == np.uint64(word)]
                self._words[mine] = 0

    def all_equal(self, word: int, block_ids: Sequence[int]) -> bool:
        """Every block's word is `word` (D: the words just read into its scratch)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return bool(ids.size) and bool(np.all(self._words[ids] == np.uint64(word)))

    def reset(self, block_ids: Sequence[int]) -> None:
        """D: forget the words read into these scratch slots (before a new read into them)."""
        if block_ids:
            self._words[np.asarray(block_ids, dtype=np.int64)] = 0
