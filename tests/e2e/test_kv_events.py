"""vLLM's KV-cache events (what KV-aware routers route by) stay right with our connector in P and D.

P and D publish BlockStored / BlockRemoved / AllBlocksCleared over ZMQ (`--kv-events-config`); a
SUB socket per server records every batch. Checked: P reports the prompt's full blocks; D reports
the blocks it loaded from P, with P's hashes for the same tokens (vLLM's sha256 block hashes are
seeded alike in every process: a router can match them across instances); P never reports a held
prompt's blocks removed before D loaded them, although evictions happen around them (P's KV cache
is 32 blocks); every batch arrives (sequence numbers without a gap)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kv_connectors.proxy.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvc_testing.cluster import (
    ProxyProcess,
    generate,
    kv_events_args,
    make_prompts,
    output_ids,
    pd_server,
    prefill,
    stats,
    wait_until,
)
from kvc_testing.load import proxy_health, proxy_metric
from kvc_testing.procs import VllmServer, free_port
from tests.e2e.conftest import MAX_MODEL_LEN

BLOCK_SIZE = 32  # VllmServer's --block-size
MAX_TOKENS = 4
# The tiny model's KV is 32 KiB per block: P holds 32 blocks, so three 480-token prompts evict
# every block nobody holds. D keeps its default 64 MiB (no eviction there).
P_KV_BYTES = 1024 * 1024
FILLER = make_prompts([480, 480, 480], seed=291)
WARM_UP = make_prompts([70], seed=292)[0]
PROMPTS = make_prompts([100, 200, 330], seed=293)  # 3, 6, 10 full blocks
CONTROL, HELD = make_prompts([200, 200], seed=294)
REFUSED, SENTINEL = make_prompts([130, 70], seed=295)


@dataclass
class Received:
    at: float  # time.monotonic() when the batch arrived here
    seq: int
    event: BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class Subscriber:
    """A SUB socket on one server's publisher, recording every event on a thread of its own."""

    port: int
    topic: str
    received: list[Received] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.topic}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.connect(f"tcp://127.0.0.1:{self.port}")
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                topic, seq, payload = sock.recv_multipart()
                batch = decoder.decode(payload)
                now = time.monotonic()
                with self._lock:
                    self.seqs.append(int.from_bytes(seq, "big"))
                    self.received += [Received(now, self.seqs[-1], e) for e in batch.events]
        except BaseException as e:  # noqa: BLE001 - reported by events()
            self._error = e
        finally:
            sock.close(linger=0)
            ctx.term()

    def events(self) -> list[Received]:
        if self._error is not None:
            raise AssertionError(f"subscriber {self.topic} failed: {self._error!r}")
        with self._lock:
            return list(self.received)

    def sequence(self) -> list[int]:
        """The sequence numbers of the batches received, in order."""
        with self._lock:
            return list(self.seqs)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Cluster:
    p: VllmServer
    d: VllmServer
    proxy: ProxyProcess
    p_events: Subscriber
    d_events: Subscriber


@pytest.fixture(scope="module")
def cluster(tiny_model) -> Iterator[Cluster]:
    p_port, d_port = free_port(), free_port()
    p = pd_server(
        tiny_model,
        "kv_producer",
        name="P-kv-events",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=P_KV_BYTES,
        extra_args=kv_events_args(p_port, "kvc-P"),
    )
    d = pd_server(
        tiny_model,
        "kv_consumer",
        name="D-kv-events",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"handshake_timeout_s": 5, "transfer_timeout_s": 10},
        extra_args=kv_events_args(d_port, "kvc-D"),
    )
    with contextlib.ExitStack() as stack:
        # Subscribed before the servers bind: no event is published before the first request.
        p_events, d_events = Subscriber(p_port, "kvc-P"), Subscriber(d_port, "kvc-D")
        stack.callback(p_events.close)
        stack.callback(d_events.close)
        for server in (p, d):  # both start at once, then both are awaited
            server.start()
            stack.callback(server.stop)
        for server in (p, d):
            server.wait_ready()
        proxy = stack.enter_context(ProxyProcess([p.url], [d.url]))
        proxy.wait_ready()
        c = Cluster(p, d, proxy, p_events, d_events)
        # ZMQ's slow joiner: a SUB socket may miss the first batches after it connects. Wait until a
        # request's events reach both subscribers; the tests then look only at their own prompts.
        assert generate(proxy.url, WARM_UP, MAX_TOKENS).status_code == 200
        wait_until(lambda: chain(p_events, WARM_UP) and chain(d_events, WARM_UP), 15, "the warm-up prompt's events on P and D")
        yield c


def full_blocks(prompt: list[int]) -> list[list[int]]:
    return [prompt[i : i + BLOCK_SIZE] for i in range(0, len(prompt) - BLOCK_SIZE + 1, BLOCK_SIZE)]


def stored_blocks(sub: Subscriber) -> dict[tuple[Any, tuple[int, ...]], tuple[Any, float]]:
    """(parent hash, block's tokens) -> (block hash, when first heard), from every BlockStored."""
    out: dict[tuple[Any, tuple[int, ...]], tuple[Any, float]] = {}
    for r in sub.events():
        e = r.event
        if not isinstance(e, BlockStored):
            continue
        assert e.block_size == BLOCK_SIZE, e
        assert len(e.token_ids) == len(e.block_hashes) * BLOCK_SIZE, e
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            out.setdefault((parent, tuple(e.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])), (h, r.at))
            parent = h
    return out


def chain(sub: Subscriber, prompt: list[int]) -> list[tuple[Any, float]] | None:
    """The (hash, when heard) of each of the prompt's full blocks the server reported stored, walked
    from the first block's (no parent); None while one is missing."""
    known, parent, out = stored_blocks(sub), None, []
    for block in full_blocks(prompt):
        hit = known.get((parent, tuple(block)))
        if hit is None:
            return None
        out.append(hit)
        parent = hit[0]
    return out


def hashes(sub: Subscriber, prompt: list[int], timeout: float = 10) -> list[Any]:
    got = wait_until(lambda: chain(sub, prompt), timeout, f"{sub.topic}'s BlockStored for a {len(prompt)}-token prompt")
    return [h for h, _ in got]


def removed(sub: Subscriber, wanted: list[Any]) -> list[Received]:
    return [r for r in sub.events() if isinstance(r.event, BlockRemoved) and set(r.event.block_hashes) & set(wanted)]


def test_p_and_d_report_the_blocks_d_loaded_with_ps_hashes(cluster: Cluster) -> None:
    for prompt in PROMPTS:
        d0 = stats(cluster.d)
        assert output_ids(generate(cluster.proxy.url, prompt, MAX_TOKENS))
        d1 = stats(cluster.d)
        # D loaded the prompt from P (every block, the partial last one too), computed none of it.
        assert d1.recv_transfers - d0.recv_transfers == 1, "D did not load this prompt from P"
        assert d1.recv_blocks - d0.recv_blocks == -(-len(prompt) // BLOCK_SIZE)
        p_hashes, d_hashes = hashes(cluster.p_events, prompt), hashes(cluster.d_events, prompt)
        assert len(p_hashes) == len(prompt) // BLOCK_SIZE
        assert d_hashes == p_hashes, "D's BlockStored for the blocks it loaded name other hashes than P's"
        assert len(set(p_hashes)) == len(p_hashes)


def test_p_reports_no_held_block_removed_before_d_loaded_it(cluster: Cluster) -> None:
    p, d = cluster.p, cluster.d
    # CONTROL is computed on P and freed at once (it stays in P's prefix cache until evicted);
    # HELD is prefilled for a D: P holds its blocks under a lease until D has read them.
    assert output_ids(generate(p.url, CONTROL, 1))
    params = prefill(p.url, HELD)
    control, held = hashes(cluster.p_events, CONTROL), hashes(cluster.p_events, HELD)
    assert stats(p).held_blocks >= len(held)
    for prompt in FILLER:  # plain requests on P: they evict every block nobody holds
        assert output_ids(generate(p.url, prompt, 1))
    wait_until(
        lambda: set(control) <= {h for r in removed(cluster.p_events, control) for h in r.event.block_hashes},
        10,
        "P to evict the control prompt",
    )
    assert not removed(cluster.p_events, held), "P reported a held block removed before D read it"

    d0 = stats(d)
    assert output_ids(generate(d.url, HELD, MAX_TOKENS, kv_transfer_params=params))
    d1 = stats(d)
    assert d1.recv_transfers - d0.recv_transfers == 1 and d1.recv_blocks - d0.recv_blocks == -(-len(HELD) // BLOCK_SIZE)
    loaded_at = time.monotonic()
    assert hashes(cluster.d_events, HELD) == held

    # Once D is done P frees the blocks; the next prompts evict them, and P reports that (after D's load).
    wait_until(lambda: stats(p).held_blocks == 0, 10, "P to free the held blocks")
    for prompt in FILLER:
        assert output_ids(generate(p.url, prompt, 1))
    gone = wait_until(lambda: removed(cluster.p_events, held), 10, "P's BlockRemoved for the freed prompt's blocks")
    assert all(r.at > loaded_at for r in gone), "P reported a held block removed before D loaded it"


def test_d_reports_no_blocks_for_a_load_that_failed(cluster: Cluster) -> None:
    """D's request names a lease P does not hold (as a stale or replayed answer does): P refuses the
    read, D fails the request (vLLM's default kv_load_failure_policy "fail"), and D must not tell a
    router it holds the prompt: no BlockStored for its blocks."""
    p, d = cluster.p, cluster.d
    params = {**prefill(p.url, REFUSED), "remote_request_id": "kvc-test-no-such-lease"}
    p_hashes = hashes(cluster.p_events, REFUSED)
    d0 = stats(d)
    r = generate(d.url, REFUSED, MAX_TOKENS, kv_transfer_params=params, timeout=60)
    assert stats(d).recv_failures - d0.recv_failures == 1
    # Batches are published in order: once a later request's events arrived, the failed one's did.
    assert output_ids(generate(cluster.proxy.url, SENTINEL, MAX_TOKENS))
    hashes(cluster.d_events, SENTINEL)
    assert chain(cluster.d_events, REFUSED) is None, "D reported blocks stored for a load that failed"
    d_stored = {h for r in cluster.d_events.events() if isinstance(r.event, BlockStored) for h in r.event.block_hashes}
    assert not d_stored & set(p_hashes), "D reported blocks stored for a load that failed"
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:300]


def test_every_batch_arrived_and_nothing_was_cleared(cluster: Cluster) -> None:
    for sub in (cluster.p_events, cluster.d_events):
        seqs = sub.sequence()
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"{sub.topic} lost batches"
        assert not [r for r in sub.events() if isinstance(r.event, AllBlocksCleared)]


def test_our_proxy_routes_by_what_ds_events_say_it_holds(cluster: Cluster) -> None:
    """The proxy's prefix policy fed by D's real publisher (--kv-events). D is listed twice, under two
    spellings of its address: 'localhost' first, whose publisher endpoint is silent, then '127.0.0.1'
    with D's events. A prompt computed through the other proxy was never routed by this one, so round
    robin and the estimate both choose 'localhost'; D's events say it holds the prompt's blocks, so
    every turn that extends it goes to '127.0.0.1'. A chat conversation likewise: the proxy matches the
    token ids D's /tokenize renders (the chat template applied) against the events."""
    d_port = int(cluster.d.url.rsplit(":", 1)[1])
    silent, heard = f"http://localhost:{d_port}", f"http://127.0.0.1:{d_port}"
    quiet_port = free_port()  # nobody publishes there
    args = ["--decode-policy", "prefix", "--prefix-chunk-tokens", str(BLOCK_SIZE)]
    args += [
        "--kv-events",
        f"{silent}=tcp://127.0.0.1:{quiet_port}",
        "--kv-events",
        f"{heard}=tcp://127.0.0.1:{cluster.d_events.port}",
    ]
    history = make_prompts([256], seed=296)[0]  # 8 full blocks
    proxy = ProxyProcess([cluster.p.url], [silent, heard], extra_args=args)
    with proxy:
        proxy.wait_ready()
        expected = output_ids(generate(cluster.proxy.url, history, MAX_TOKENS))  # D holds it now
        hashes(cluster.d_events, history)  # and has said so
        wait_until(lambda: _kv_events(proxy, heard)["batches"] > 0, 15, "the proxy to hear D's events")
        for turn in range(3):
            prompt = history + make_prompts([40], seed=297 + turn)[0]
            assert output_ids(generate(proxy.url, prompt, MAX_TOKENS)) == output_ids(
                generate(cluster.proxy.url, prompt, MAX_TOKENS)
            )
        assert output_ids(generate(proxy.url, history, MAX_TOKENS)) == expected
        opening = [{"role": "user", "content": " ".join(f"item {i} of the list" for i in range(20))}]  # ~210 tokens
        batches = _kv_events(proxy, heard)["batches"]
        assert _chat(cluster.proxy.url, opening).status_code == 200  # D holds the opening now
        wait_until(lambda: _kv_events(proxy, heard)["batches"] > batches, 15, "D's events for the chat opening")
        time.sleep(0.5)  # the load's BlockStored may follow the batch of the request's start
        turn = [*opening, {"role": "assistant", "content": "noted"}, {"role": "user", "content": "and the next one?"}]
        assert (
            _chat(proxy.url, turn).json()["choices"][0]["message"] == _chat(cluster.proxy.url, turn).json()["choices"][0]["message"]
        )
        served = {b["url"]: b["served"] for b in proxy_health(proxy)["decode"]}
        assert served == {silent: 0, heard: 5}, served
        assert proxy_metric(proxy, "kvc_proxy_prefix_decisions_total", role="decode", result="hit") == 5
        assert _kv_events(proxy, heard)["undecodable"] == 0 and _kv_events(proxy, silent)["batches"] == 0


def _chat(url: str, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _kv_events(proxy: ProxyProcess, url: str) -> dict[str, Any]:
    return next(b["kv_events"] for b in proxy_health(proxy)["decode"] if b["url"] == url)
