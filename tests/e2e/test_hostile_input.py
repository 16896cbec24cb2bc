"""Hostile input against live servers: a fuzz of P's and D's side channels (random and mutated
frames, wrong hash, oversize frames, empty pushes, unknown keys, impossible ids), and of
kv_transfer_params through D's HTTP API. Every bad request gets an error; afterwards both serve
greedy-exact requests, memory stays bounded and P holds no blocks."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from kv_connectors import wire
from kvc_testing.cluster import generate, make_prompts, output_ids, prefill, stats, wait_until
from tests.e2e.checks import MAX_TOKENS

FUZZ_MESSAGES = 2500
RSS_GROWTH_LIMIT = 256 * 1024 * 1024


def _server_hash(port: int) -> str:
    """Any reply's header carries the server's compatibility hash (as a peer would learn it)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(wire.encode(wire.StatsRequest(), ""))
        assert sock.poll(5000), "side channel did not answer"
        header = msgspec.msgpack.decode(sock.recv(), type=tuple[wire.Header, msgspec.Raw])[0]
        return header.compat_hash
    finally:
        sock.close(0)


def _frames(rng: random.Random, good_hash: str, compat: wire.CompatInfo | None) -> list[bytes]:
    def ids() -> list[int]:
        return [rng.choice([0, 1, 2**31, 2**63 - 1, -1, rng.randrange(10**6)]) for _ in range(rng.randrange(8))]

    def key() -> str:
        return rng.choice(["", "x" * 300, f"cmpl-{rng.random()}", "kvc-fuzz"])

    h = rng.choice([good_hash, good_hash, "0" * 32, ""])
    bodies: list[wire.Body] = [
        wire.ClaimRequest(key(), [wire.ClaimItem(key(), ids()) for _ in range(rng.randrange(5))], epoch=rng.choice(["", "stale"])),
        wire.PushRequest(key(), key(), key(), key(), rng.choice([[], ids(), list(range(100_000))])),
        wire.RenewRequest(key(), [key() for _ in range(rng.randrange(5))]),
        wire.StatsRequest(),
        wire.TransferDone(key(), key()),
    ]
    if compat is not None:
        bodies.append(wire.HandshakeRequest(key(), 0, msgspec.structs.replace(compat, num_layers=rng.randrange(9))))
    frame = bytearray(wire.encode(rng.choice(bodies), h))
    mutated = bytearray(frame)
    for _ in range(rng.randrange(1, 5)):
        mutated[rng.randrange(len(mutated))] = rng.randrange(256)
    return [bytes(frame), bytes(mutated), rng.randbytes(rng.randrange(1, 200))]


def _fuzz(port: int, rng: random.Random, n: int) -> dict[str, int]:
    """n frames through one DEALER socket (no lock-step), then oversize ones; count what came back."""
    good_hash = _server_hash(port)
    compat = wire.CompatInfo(
        architecture="LlamaForCausalLM",
        num_layers=2,
        hidden_size=128,
        num_kv_heads=2,
        head_size=32,
        vocab_size=1024,
        dtype="float32",
        block_size=32,
        layout=(32, 2, 4096),
    )
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sent = answered = 0
    try:
        while sent < n:
            for frame in _frames(rng, good_hash, compat):
                sock.send_multipart([b"", frame])
                sent += 1
            while sock.poll(0):
                sock.recv_multipart()
                answered += 1
        deadline = time.monotonic() + 60
        while answered < sent and time.monotonic() < deadline:
            if sock.poll(1000):
                sock.recv_multipart()
                answered += 1
    finally:
        sock.close(0)
    # Oversize frames (beyond side_channel_max_msg_kib): dropped unread, the connection closed.
    for _ in range(3):
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(f"tcp://127.0.0.1:{port}")
        big.send_multipart([b"", b"\x01" * (24 << 20)])
        time.sleep(0.2)
        big.close(0)
    return {"sent": sent, "answered": answered}


def _serves_exact(reference, prefill_server, decode_server, seed: int) -> None:
    for prompt in make_prompts([90, 200], seed=seed):
        params = prefill(prefill_server.url, prompt)
        got = output_ids(generate(decode_server.url, prompt, MAX_TOKENS, kv_transfer_params=params))
        assert got == output_ids(generate(reference.url, prompt, MAX_TOKENS))


def test_side_channel_fuzz_leaves_p_and_d_serving(reference, prefill_server, decode_server):
    _serves_exact(reference, prefill_server, decode_server, seed=201)
    rss0 = {s.name: s.group_rss_bytes() for s in (prefill_server, decode_server)}
    rng = random.Random(2026)
    for server in (prefill_server, decode_server):
        counts = _fuzz(server.side_channel_port, rng, FUZZ_MESSAGES)
        # Every well-framed request gets an answer (errors included); none crashes the listener.
        assert counts["answered"] >= counts["sent"] * 0.9, counts
        assert server.is_running()
    _serves_exact(reference, prefill_server, decode_server, seed=202)
    for server in (prefill_server, decode_server):
        growth = server.group_rss_bytes() - rss0[server.name]
        assert growth < RSS_GROWTH_LIMIT, f"{server.name} grew {growth / 2**20:.0f} MiB under the fuzz"
    wait_until(lambda: stats(prefill_server).held_blocks == 0, 15, "P to hold no blocks after the fuzz")
    for server in (prefill_server, decode_server):  # the engine handled it all; the hook guard never fired
        assert "KV connector hook" not in server.log_tail(3000)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda p: {**p, "remote_block_ids": [2**63 - 1] + p["remote_block_ids"][1:]}, id="id-int64-max"),
        pytest.param(lambda p: {**p, "remote_block_ids": [2**63] + p["remote_block_ids"][1:]}, id="id-beyond-int64"),
        pytest.param(lambda p: {**p, "remote_block_ids": [-5] + p["remote_block_ids"][1:]}, id="id-negative"),
        pytest.param(
            lambda p: {**p, "remote_block_ids": [p["remote_block_ids"][0] + 10**6] + p["remote_block_ids"][1:]},
            id="id-beyond-peer-cache",
        ),
        pytest.param(lambda p: {**p, "remote_block_ids": list(range(200_000))}, id="huge-list"),
        pytest.param(lambda p: {**p, "remote_block_ids": [1.5] * len(p["remote_block_ids"])}, id="float-ids"),
        pytest.param(lambda p: {**p, "remote_request_id": 7}, id="request-id-not-str"),
        pytest.param(lambda p: {**p, "remote_port": 70000}, id="port-out-of-range"),
        pytest.param(lambda p: {**p, "remote_port": 1}, id="nothing-listening"),
        pytest.param(lambda p: {**p, "remote_request_id": p["remote_request_id"] + "-other"}, id="unknown-key"),
    ],
)
def test_hostile_kv_transfer_params_get_an_error(reference, prefill_server, decode_server, mutate):
    prompt = make_prompts([100], seed=203)[0]
    params = prefill(prefill_server.url, prompt)
    r = generate(decode_server.url, prompt, MAX_TOKENS, kv_transfer_params=mutate(params), timeout=60)
    failed = r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error"
    if not failed:  # served: then it must not have used another prompt's KV
        pytest.fail(f"D answered 200 to hostile params: {r.text[:300]}")
    assert decode_server.is_running()
    _serves_exact(reference, prefill_server, decode_server, seed=204)


def test_p_holds_nothing_after_the_hostile_requests(prefill_server, decode_server):
    """Freed on D's notice or release where the params still named P, else by P's 30 s lease."""
    wait_until(lambda: stats(prefill_server).held_blocks == 0, 45, "P to free every block")
    assert "KV connector hook" not in decode_server.log_tail(3000)
