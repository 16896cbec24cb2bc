"""Prefix caches learned from vLLM's KV events: what a backend holds, told by its own publisher.

vLLM publishes (`--kv-events-config`, publisher `zmq`) one batch of events per engine step: BlockStored
(the hashes of the blocks now cached, their parent's hash, their token ids), BlockRemoved and
AllBlocksCleared. A backend's `EventPrefixCache` keeps, for each block its server holds, the proxy's own
chunk hash of that block (`prefix.prompt_key`'s chain over `block_size` token ids), so a token-id prompt's
key matches what the server has cached, block for block, instead of what the proxy last sent it. The
prefix chunk must be the servers' block size (`--prefix-chunk-tokens` = vLLM's `--block-size`): events of
another block size are counted and ignored. Text and chat prompts are first rendered to token ids by a
D's /tokenize (`dispatch`, `tokens`); one that could not be rendered is matched by the estimating cache,
as without events.

A publisher's bytes are not trusted: a batch that does not decode is counted and skipped, messages are
bounded in size, and the blocks remembered are bounded by the cache's capacity (oldest out)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import zmq

from .prefix import PrefixCache, PromptKey

logger = logging.getLogger("kv_connectors.proxy")

MAX_MESSAGE_BYTES = 64 << 20
POLL_MS = 100


# vLLM's wire format (vllm/distributed/kv_events.py), the fields read here: a batch is an array, each
# event a map tagged with its class name; fields not named here are ignored.
class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass
class EventCounts:
    """What a backend's publisher sent, as the cache took it."""

    batches: int = 0
    undecodable: int = 0  # batches skipped: not vLLM's format
    missed: int = 0  # batches lost between two received (sequence numbers jumped)
    foreign_block_size: int = 0  # BlockStored of a block size other than the prefix chunk
    unchained: int = 0  # BlockStored whose parent block is unknown here (stored before we listened)


@dataclass
class EventPrefixCache:
    """One backend's cached blocks as its KV events tell them, by the proxy's chunk hash; text prompts
    fall back to `estimate`. Events arrive on the subscriber's thread, lookups on the proxy's loop."""

    chunk_tokens: int
    capacity: int
    estimate: PrefixCache
    counts: EventCounts = field(default_factory=EventCounts)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._chain: OrderedDict[bytes | int, int] = OrderedDict()  # vLLM's block hash -> our chunk hash
        self._held: dict[int, int] = {}  # our chunk hash -> blocks holding it

    def __len__(self) -> int:
        return len(self._chain) + len(self.estimate)

    def match(self, key: PromptKey) -> int:
        """How many leading chunks of `key` the backend holds (text: as estimated)."""
        if key.text:
            return self.estimate.match(key)
        with self._lock:
            n = 0
            for h in key.hashes:
                if h not in self._held:
                    break
                n += 1
            return n

    def insert(self, key: PromptKey) -> None:
        """A prompt routed here: only text is estimated; the server's events tell the rest."""
        if key.text:
            self.estimate.insert(key)

    def forget(self) -> None:
        self.restarted()
        self.estimate.forget()

    def restarted(self) -> None:
        """The server restarted (the subscriber's thread): none of the blocks it told of is held now. The
        text estimate is the proxy loop's alone (an LRU it walks unlocked) and stays, as without events."""
        with self._lock:
            self._chain.clear()
            self._held.clear()

    def apply(self, batch: KVEventBatch) -> None:
        with self._lock:
            self.counts.batches += 1
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._stored(event)
                elif isinstance(event, BlockRemoved):
                    for block in event.block_hashes:
                        self._drop(self._chain.pop(block, None))
                else:
                    self._chain.clear()
                    self._held.clear()

    def _stored(self, event: BlockStored) -> None:
        size = event.block_size
        if size != self.chunk_tokens:
            self.counts.foreign_block_size += 1
            return
        parent = event.parent_block_hash
        prev = 0 if parent is None else self._chain.get(parent)
        if prev is None:
            self.counts.unchained += 1
            return
        tokens = event.token_ids
        for i, block in enumerate(event.block_hashes):
            piece = tuple(tokens[i * size : (i + 1) * size])
            if len(piece) != size:
                return
            prev = hash((prev, piece))  # prefix.prompt_key's chain
            self._drop(self._chain.pop(block, None))
            self._chain[block] = prev
            self._held[prev] = self._held.get(prev, 0) + 1
        while len(self._chain) > self.capacity:
            self._drop(self._chain.popitem(last=False)[1])

    def _drop(self, chunk: int | None) -> None:
        if chunk is None:
            return
        left = self._held.get(chunk, 0) - 1
        if left > 0:
            self._held[chunk] = left
        else:
            self._held.pop(chunk, None)


class EventSubscriber:
    """A SUB socket on one backend's KV event publisher, feeding its cache on a thread of its own."""

    def __init__(self, endpoint: str, cache: EventPrefixCache, name: str) -> None:
        self.endpoint, self.cache, self.name = endpoint, cache, name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"kv-events {self.name}", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        last_seq: int | None = None
        try:
            sock.connect(self.endpoint)
            logger.info("%s: learning its prefix cache from KV events at %s", self.name, self.endpoint)
            while not self._stop.is_set():
                if not sock.poll(POLL_MS):
                    continue
                frames = sock.recv_multipart()
                try:
                    if len(frames) != 3:
                        raise ValueError(f"{len(frames)} frames, expected topic, sequence and payload")
                    seq = int.from_bytes(frames[1], "big")
                    batch = decoder.decode(frames[2])
                except (ValueError, msgspec.DecodeError) as e:
                    self.cache.counts.undecodable += 1
                    logger.debug("%s: KV event batch skipped: %s", self.name, e)
                    continue
                if last_seq is not None and seq > last_seq + 1:
                    self.cache.counts.missed += seq - last_seq - 1
                elif last_seq is not None and seq <= last_seq:  # the server restarted: it holds nothing of before
                    self.cache.restarted()
                last_seq = seq
                self.cache.apply(batch)
        except zmq.ZMQError as e:
            logger.error("%s: KV event subscription to %s ended: %s", self.name, self.endpoint, e)
        finally:
            sock.close(linger=0)
            ctx.term()
