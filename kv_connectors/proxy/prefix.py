"""Approximate prefix caches, one per backend: which prompt prefixes each backend has seen lately.

A prompt becomes a chain of chunk hashes (chunk i's hash covers chunks 0..i), so one set lookup per chunk
says whether a backend has seen that whole prefix; a backend's set is an LRU of at most `capacity`
chunks. Token ids are cut every `chunk` ids, text every `chunk * CHARS_PER_TOKEN` characters; a prompt's
last, partial chunk is left out (vLLM caches whole blocks only)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4  # text is cut by characters; ~4 per token for English with common tokenizers


@dataclass(frozen=True)
class PromptKey:
    """A prompt's chunk hashes, and how many tokens (ids) or characters (text) a chunk covers."""

    hashes: tuple[int, ...]
    unit_per_chunk: int
    units: int  # the whole prompt's length in ids or characters
    text: bool

    def covered_fraction(self, chunks: int) -> float:
        """The share of the prompt that `chunks` leading chunks cover."""
        return min(1.0, chunks * self.unit_per_chunk / self.units) if self.units else 0.0


def _chat_text(messages: Sequence[Any]) -> str:
    """Messages as one string, role and content of each (a content list is rendered as JSON)."""
    parts = []
    for m in messages:
        if isinstance(m, dict):
            content = m.get("content")
            parts.append(f"{m.get('role')}\x00{content if isinstance(content, str) else json.dumps(content, sort_keys=True)}\x01")
    return "".join(parts)


def prompt_key(prompt: str | Sequence[int] | None, messages: Sequence[Any] | None, chunk: int) -> PromptKey:
    """The key of one prompt: completions' text or ids, or chat's messages."""
    if messages is not None:
        prompt = _chat_text(messages)
    if isinstance(prompt, str):
        size = chunk * CHARS_PER_TOKEN
        pieces: list[Any] = [prompt[i : i + size] for i in range(0, len(prompt) - size + 1, size)]
        text, units = True, len(prompt)
    elif prompt is not None:
        ids = tuple(prompt)
        size = chunk
        pieces = [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]
        text, units = False, len(ids)
    else:
        return PromptKey((), chunk, 0, False)
    hashes, h = [], 0
    for piece in pieces:
        h = hash((h, piece))
        hashes.append(h)
    return PromptKey(tuple(hashes), size, units, text)


class PrefixCache:
    """One backend's recently seen chunk hashes, least recently used first out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def match(self, key: PromptKey) -> int:
        """How many leading chunks of `key` this backend has seen (a hit refreshes them)."""
        n = 0
        for h in key.hashes:
            if h not in self._seen:
                break
            self._seen.move_to_end(h)
            n += 1
        return n

    def insert(self, key: PromptKey) -> None:
        for h in key.hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def forget(self) -> None:
        self._seen.clear()
