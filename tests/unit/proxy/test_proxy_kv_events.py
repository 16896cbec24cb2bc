"""The prefix policy learning from vLLM's KV events (--kv-events): a backend's cache is what its server
says it holds (stored, removed, cleared), not what the proxy last sent it; batches come over a real ZMQ
PUB socket, encoded by vLLM's own event classes; a publisher's bad bytes are skipped and counted."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kv_connectors.proxy.config import BackendSpec, Policy, PrefixSettings
from kv_connectors.proxy.flags import parse_args
from kv_connectors.proxy.kvevents import EventPrefixCache
from kv_connectors.proxy.kvevents import KVEventBatch as OurBatch
from kv_connectors.proxy.prefix import PrefixCache, prompt_key
from kvc_testing.procs import free_port
from tests.unit.proxy.proxy_fakes import D1, D2, P1, Fleet, config, running

pytestmark = pytest.mark.anyio

BLOCK = 4
PROMPT = list(range(100, 116))  # 4 blocks


def stored(tokens: list[int], hashes: list[bytes], parent: bytes | None = None, size: int = BLOCK) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def encoded(*events: object) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=list(events)))


def cache(capacity: int = 100) -> EventPrefixCache:
    return EventPrefixCache(BLOCK, capacity, PrefixCache(capacity))


def apply(c: EventPrefixCache, *events: object) -> None:
    c.apply(msgspec.msgpack.decode(encoded(*events), type=OurBatch))


def test_the_cache_holds_what_the_events_say() -> None:
    c = cache()
    key = prompt_key(PROMPT, None, BLOCK)
    assert c.match(key) == 0
    apply(c, stored(PROMPT[:8], [b"h0", b"h1"]))
    assert c.match(key) == 2
    apply(c, stored(PROMPT[8:16], [b"h2", b"h3"], parent=b"h1"))  # a later step: chained to its parent
    assert c.match(key) == 4
    apply(c, BlockRemoved(block_hashes=[b"h2"], medium="GPU"))
    assert c.match(key) == 2  # a prefix match stops at the first block evicted
    apply(c, AllBlocksCleared())
    assert c.match(key) == 0 and len(c) == 0


def test_routing_alone_teaches_nothing_for_token_prompts_but_text_is_still_estimated() -> None:
    c = cache()
    key = prompt_key(PROMPT, None, BLOCK)
    c.insert(key)
    assert c.match(key) == 0  # the server has not said it stored anything
    text = prompt_key("x" * 64, None, BLOCK)
    c.insert(text)
    assert c.match(text) == 4  # text carries no token ids: the estimate, as without events


def test_other_block_sizes_unknown_parents_and_bounds() -> None:
    c = cache(capacity=3)
    apply(c, stored(PROMPT[:8], [b"x"], size=8))
    apply(c, stored(PROMPT[4:8], [b"y"], parent=b"never-seen"))
    assert (c.counts.foreign_block_size, c.counts.unchained, len(c)) == (1, 1, 0)
    apply(c, stored(PROMPT, [b"h0", b"h1", b"h2", b"h3"]))
    assert len(c) == 3  # the oldest block out
    assert c.match(prompt_key(PROMPT, None, BLOCK)) == 0  # its first block is gone: no prefix left
    apply(c, stored(PROMPT[:4], [b"h0"]))  # stored again: in, and the next oldest (h1) out
    assert c.match(prompt_key(PROMPT, None, BLOCK)) == 1 and len(c) == 3


def test_kv_events_flags() -> None:
    base = ["--prefill", "p:1", "--decode", "d:2", "--decode", "d:3", "--decode-policy", "prefix"]
    cfg = parse_args([*base, "--kv-events", "http://d:2=tcp://10.0.0.5:5557", "--kv-events", "d:3=tcp://h:1"])
    assert [s.kv_events for s in cfg.decode] == ["tcp://10.0.0.5:5557", "tcp://h:1"]
    assert cfg.prefill[0].kv_events is None
    for bad in ("d:2", "d:2=http://h:1", "d:2=tcp://h", "x:9=tcp://h:1"):
        with pytest.raises(SystemExit):
            parse_args([*base, "--kv-events", bad])
    with pytest.raises(SystemExit):  # events feed the prefix policy only
        parse_args(["--prefill", "p:1", "--decode", "d:2", "--kv-events", "d:2=tcp://h:1"])


class Publisher:
    """A vLLM-shaped publisher: PUB socket, frames (topic, sequence, payload)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.seq = 0

    def send(self, payload: bytes, frames: list[bytes] | None = None) -> None:
        self.seq += 1
        self.sock.send_multipart(frames or [b"kv", self.seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


async def _until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the proxy did not take the events in time"
        await asyncio.sleep(0.02)


async def test_the_decode_that_stored_the_prefix_gets_the_next_turn() -> None:
    """Round robin and the estimate would both send this prompt to D1 (nothing routed yet); D2's events say
    it holds the prompt's blocks, so the proxy sends it to D2. When D2 evicts them, D1 again."""
    publishers = {D1: Publisher(), D2: Publisher()}
    fleet = Fleet(decode=(D1, D2))
    base = config(decode=(D1, D2), decode_policy=Policy.PREFIX, prefix=PrefixSettings(chunk_tokens=BLOCK))
    cfg = type(base)(
        **{
            **base.__dict__,
            "decode": tuple(BackendSpec(u, kv_events=f"tcp://127.0.0.1:{publishers[u].port}") for u in (D1, D2)),
        }
    )
    try:
        async with running(cfg, fleet) as (app, client):
            d1, d2 = app.state.proxy.decode.backends
            for _ in range(100):  # a SUB socket drops what was published before it connected: send until heard
                publishers[D2].send(encoded(stored(PROMPT, [b"h0", b"h1", b"h2", b"h3"])))
                publishers[D1].send(b"\x93not a batch")  # a publisher's bad bytes: skipped, counted
                await asyncio.sleep(0.05)
                if d2.prefix.counts.batches and d1.prefix.counts.undecodable:
                    break
            assert (await client.post("/v1/completions", json={"prompt": PROMPT + [1, 2]})).status_code == 200
            assert fleet.urls()[-1] == D2
            publishers[D2].send(encoded(BlockRemoved(block_hashes=[b"h0"], medium="GPU")))
            await _until(lambda: d2.prefix.match(prompt_key(PROMPT, None, BLOCK)) == 0)
            assert (await client.post("/v1/completions", json={"prompt": PROMPT + [3]})).status_code == 200
            assert fleet.urls()[-1] == D1
            health = (await client.get("/health")).json()
        events = {b["url"]: b["kv_events"] for b in health["decode"]}
        assert events[D1]["undecodable"] >= 1 and events[D1]["batches"] == 0
        assert events[D2]["batches"] >= 2 and events[D2]["undecodable"] == 0
    finally:
        for p in publishers.values():
            p.close()


async def test_a_chat_prompt_is_matched_by_the_token_ids_a_d_renders() -> None:
    """Chat carries no token ids: with --kv-events the proxy asks a D's /tokenize (the chat template
    applied) and matches those ids against the events; without an answer it estimates, as before."""
    publisher = Publisher()
    fleet = Fleet(decode=(D1, D2))  # its /tokenize: one token per word plus 3, ids 0, 1, 2, ...
    base = config(decode=(D1, D2), decode_policy=Policy.PREFIX, prefix=PrefixSettings(chunk_tokens=BLOCK))
    specs = (BackendSpec(D1), BackendSpec(D2, kv_events=f"tcp://127.0.0.1:{publisher.port}"))
    cfg = type(base)(**{**base.__dict__, "decode": specs})
    messages = [{"role": "user", "content": "one two three four five six seven eight nine"}]  # 12 tokens
    try:
        async with running(cfg, fleet) as (app, client):
            d2 = app.state.proxy.decode.backends[1]
            for _ in range(100):
                publisher.send(encoded(stored(list(range(8)), [b"c0", b"c1"])))
                await asyncio.sleep(0.05)
                if d2.prefix.counts.batches:
                    break
            assert (await client.post("/v1/chat/completions", json={"messages": messages})).status_code == 200
            assert fleet.urls()[-1] == D2  # round robin and the estimate say D1
            assert fleet.tokenize_calls[-1]["messages"] == messages
            fleet.tokenize_status = 500  # no ids: estimated by text, which nobody has seen
            assert (await client.post("/v1/chat/completions", json={"messages": messages})).status_code == 200
            assert fleet.urls()[-1] == D1
    finally:
        publisher.close()


async def test_a_chat_prompt_rendered_for_its_key_is_not_tokenized_again_for_local_prefill() -> None:
    """With --local-prefill-below as well, the ids rendered for the prefix key give the prompt's length:
    one /tokenize per request, and the decision is the one the count gives (12 tokens: D alone under 16,
    P and D under 8)."""
    publisher = Publisher()
    messages = [{"role": "user", "content": "one two three four five six seven eight nine"}]  # 12 tokens
    try:
        for limit, urls in ((16, [D1]), (8, [P1, D1])):
            fleet = Fleet(decode=(D1,))
            cfg = config(decode_policy=Policy.PREFIX, prefix=PrefixSettings(chunk_tokens=BLOCK), local_prefill_below=limit)
            cfg = type(cfg)(**{**cfg.__dict__, "decode": (BackendSpec(D1, kv_events=f"tcp://127.0.0.1:{publisher.port}"),)})
            async with running(cfg, fleet) as (_, client):
                assert (await client.post("/v1/chat/completions", json={"messages": messages})).status_code == 200
            assert len(fleet.tokenize_calls) == 1, fleet.tokenize_calls
            assert fleet.urls() == urls
    finally:
        publisher.close()


async def test_a_restarted_publisher_clears_what_its_events_told_only() -> None:
    """The sequence going back: the server restarted and holds none of the blocks it told of. The text
    estimate (the proxy loop's own, walked without the subscriber's lock) is left as it is."""
    from kv_connectors.proxy.kvevents import EventSubscriber

    publisher = Publisher()
    c = cache()
    text = prompt_key("x" * 64, None, BLOCK)
    c.insert(text)
    subscriber = EventSubscriber(f"tcp://127.0.0.1:{publisher.port}", c, "D")
    subscriber.start()
    key = prompt_key(PROMPT, None, BLOCK)
    try:
        for _ in range(100):
            publisher.send(encoded(stored(PROMPT, [b"h0", b"h1", b"h2", b"h3"])))  # sequence 1, 2, ...
            await asyncio.sleep(0.05)
            if c.match(key) == 4:
                break
        assert c.match(key) == 4
        publisher.send(b"", [b"kv", (0).to_bytes(8, "big"), encoded()])  # a new process's first batch
        await _until(lambda: c.match(key) == 0)
        assert c.match(text) == 4
    finally:
        subscriber.close()
        publisher.close()
