"""Shared end-to-end checks: a PD set-up's greedy output equals colocated, and P frees every block."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx

from kv_connectors.tp import reader_count, source_ranks
from kvc_testing.cluster import (
    generate,
    make_prompts,
    metric,
    output_ids,
    prefill,
    stats,
    transfer_id_params,
    wait_until,
)
from tests.e2e.conftest import MAX_MODEL_LEN

MAX_TOKENS = 8
BLOCK_SIZE = 32
TINY_KV_HEADS = 2  # kvc_testing.tiny_model's
# From 1 token to near max_model_len, on and around block boundaries.
LENGTHS = [
    1,
    2,
    3,
    7,
    16,
    31,
    32,
    33,
    47,
    63,
    64,
    65,
    96,
    127,
    128,
    129,
    191,
    200,
    255,
    256,
    257,
    320,
    383,
    449,
    480,
    MAX_MODEL_LEN - MAX_TOKENS,
]
PROMPTS = make_prompts(LENGTHS, seed=1)


# Streamed through the proxy too (first token from prefill: D's prompt is P's plus P's first token), on
# and around block boundaries; their own tokens, so that no server has them cached.
STREAMED_LENGTHS = [1, 31, 32, 33, 64, 65, 200]


def streamed_ids(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """A streamed greedy completion's output token ids (the first one from P where the proxy seeds)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}
    ids: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()[:300]
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    ids += choice.get("token_ids") or []
    return ids


def fresh_prompts(seed: int) -> list[list[int]]:
    """The same lengths as PROMPTS, other tokens: not in any server's prefix cache yet."""
    return make_prompts(LENGTHS, seed=seed)


def assert_pd_matches_colocated(
    reference, prefill_server, decode_server, proxy, prompts=PROMPTS, p_tp: int = 1, d_tp: int = 1
) -> int:
    """Every prompt through the proxy equals the colocated run (and STREAMED_LENGTHS prompts streamed);
    D loaded each one; P freed all. Returns how many prompts went through P and D.

    A D that already served these prompts has them in its prefix cache and loads fewer blocks:
    give such a D fresh prompts (`fresh_prompts`). p_tp, d_tp: the tensor-parallel sizes (each D
    rank reads each prompt from every P rank holding its heads, and each P rank frees each prompt:
    counters are checked rank by rank, /metrics sums them over ranks)."""
    lengths = [len(p) for p in prompts]
    reads = [len(source_ranks(TINY_KV_HEADS, p_tp, d_tp, r)) for r in range(d_tp)]  # per D rank, per prompt
    p_ranks0 = [stats(prefill_server, rank=r) for r in range(p_tp)]
    d_ranks0 = [stats(decode_server, rank=r) for r in range(d_tp)]
    p0, d0 = p_ranks0[0], d_ranks0[0]
    d_metric0 = metric(decode_server.url, "kvc:recv_transfers_total")
    p_metric0 = metric(prefill_server.url, "kvc:completed_sends_total")
    expected = [output_ids(generate(reference.url, p, MAX_TOKENS)) for p in prompts]
    assert len({tuple(e) for e in expected}) > len(prompts) // 2, "tiny model output is near-constant"
    got = [output_ids(generate(proxy.url, p, MAX_TOKENS)) for p in prompts]
    mismatches = [(n, e, g) for n, e, g in zip(lengths, expected, got) if e != g]
    assert not mismatches, f"PD output differs from colocated (length, expected, got): {mismatches}"
    # Streamed: the proxy's first token from P, D continuing from prompt + that token.
    streamed = make_prompts(STREAMED_LENGTHS, seed=sum(prompts[0]) + 7919)
    seeded0 = metric(proxy.url, "kvc_proxy_first_token_total")
    got_streamed = [streamed_ids(proxy.url, p) for p in streamed]
    want_streamed = [output_ids(generate(reference.url, p, MAX_TOKENS)) for p in streamed]
    mismatches = [(len(p), e, g) for p, e, g in zip(streamed, want_streamed, got_streamed) if e != g]
    assert not mismatches, f"streamed PD output differs from colocated (length, expected, got): {mismatches}"
    params_flow = httpx.get(f"{proxy.url}/health", timeout=10).json()["flow"] == "params"
    decided = metric(proxy.url, "kvc_proxy_first_token_total") - seeded0
    assert decided == (len(streamed) if params_flow else 0)  # each one seeded or not (the transfer-id flow: never)
    prompts, lengths = [*prompts, *streamed], [*lengths, *STREAMED_LENGTHS]

    for rank, d0 in enumerate(d_ranks0):
        d1 = stats(decode_server, rank=rank)
        assert d1.recv_transfers - d0.recv_transfers == len(prompts) * reads[rank], f"D rank {rank} did not load every prompt"
        assert d1.recv_failures == d0.recv_failures
        assert d1.recv_blocks - d0.recv_blocks >= sum(-(-n // BLOCK_SIZE) for n in lengths) // 2
    for rank, p0 in enumerate(p_ranks0):
        # Every block P held for D is freed once D has it: P's counters and vLLM's own gauge.
        wait_until(lambda r=rank: stats(prefill_server, rank=r).held_blocks == 0, 10, f"P rank {rank} to free the blocks D loaded")
        p1 = stats(prefill_server, rank=rank)
        assert p1.completed_sends - p0.completed_sends == len(prompts)
        assert p1.expired_leases == p0.expired_leases
    wait_until(lambda: metric(prefill_server.url, "vllm:kv_cache_usage_perc") == 0.0, 10, "P's KV usage to reach 0")
    # The same counters on each server's /metrics (through vLLM's KVConnectorStats and Prometheus hooks).
    wait_until(
        lambda: metric(decode_server.url, "kvc:recv_transfers_total") - d_metric0 == len(prompts) * sum(reads),
        10,
        "D's /metrics to count every load",
    )
    wait_until(
        lambda: metric(prefill_server.url, "kvc:completed_sends_total") - p_metric0 == len(prompts) * p_tp,
        10,
        "P's /metrics to count every completed send",
    )
    assert metric(prefill_server.url, "kvc:held_blocks") == 0
    return len(prompts)


def assert_push_matches_colocated(reference, prefill_server, decode_server, proxy, prompts=PROMPTS, p_tp=1, d_tp=1) -> int:
    """assert_pd_matches_colocated with D pushing: every P rank also wrote each prompt into each D rank
    reading it (and only that). Returns how many prompts went through P and D."""
    writes = [reader_count(TINY_KV_HEADS, p_tp, d_tp, r) for r in range(p_tp)]  # per P rank, per prompt
    p0 = [stats(prefill_server, rank=r).pushes for r in range(p_tp)]
    sent = assert_pd_matches_colocated(reference, prefill_server, decode_server, proxy, prompts, p_tp=p_tp, d_tp=d_tp)
    pushed = [stats(prefill_server, rank=r).pushes - p0[r] for r in range(p_tp)]
    assert pushed == [sent * w for w in writes], f"P's ranks wrote {pushed} times for {sent} prompts"
    return sent


def assert_foreign_kv_changes_output(reference, perturbed_producer, decode_server) -> None:
    """P with perturbed K/V weights (same compatibility hash): D's output follows P's KV.

    Without a transfer D would recompute and match the reference on every prompt."""
    prompts = PROMPTS[8:16]
    changed = 0
    for prompt in prompts:
        params = prefill(perturbed_producer.url, prompt)
        got = output_ids(generate(decode_server.url, prompt, MAX_TOKENS, kv_transfer_params=params))
        changed += got != output_ids(generate(reference.url, prompt, MAX_TOKENS))
    assert changed >= len(prompts) // 2, f"only {changed}/{len(prompts)} outputs changed with foreign KV"
    wait_until(lambda: stats(perturbed_producer).held_blocks == 0, 10, "perturbed P to free its blocks")


def assert_dead_producer_fails_fast(reference, doomed_producer, prefill_server, decode_server) -> None:
    """P dies after prefill, before D loads: D fails that request within 30 s, then keeps serving."""
    with doomed_producer:
        params = prefill(doomed_producer.url, PROMPTS[9])
        doomed_producer.stop()
    d0 = stats(decode_server)
    t0 = time.monotonic()
    r = generate(decode_server.url, PROMPTS[9], MAX_TOKENS, kv_transfer_params=params, timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:300]
    assert stats(decode_server).recv_failures == d0.recv_failures + 1
    prompt = PROMPTS[11]
    params = prefill(prefill_server.url, prompt)
    got = output_ids(generate(decode_server.url, prompt, MAX_TOKENS, kv_transfer_params=params))
    assert got == output_ids(generate(reference.url, prompt, MAX_TOKENS))
    wait_until(lambda: stats(prefill_server).held_blocks == 0, 10, "P to free the blocks")


def transfer_id_generate(prefill_server, decode_server, prompt, max_tokens: int, d_first: bool = False):
    """The transfer-id flow without a proxy: P and D get the request at once, both carrying one
    transfer id; D also gets P's side channel. With d_first, P gets its request only once D's
    scheduler holds D's (waiting for remote KV): D's worker sends its push request in that same
    step, so it is at P before P computes (layer-wise push), however slow D is to get there.
    Returns (P's, D's) responses."""
    p_params, d_params = transfer_id_params(prefill_server)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        d_future = pool.submit(generate, decode_server.url, prompt, max_tokens, kv_transfer_params=d_params)
        if d_first:
            wait_until(
                lambda: d_future.done() or metric(decode_server.url, "vllm:num_requests_waiting") >= 1,
                60,
                "D to queue its request",
                interval=0.02,
            )
            time.sleep(_PUSH_REQUEST_S)
        p_future = pool.submit(generate, prefill_server.url, prompt, 1, kv_transfer_params=p_params)
        return p_future.result(), d_future.result()


# D's push request leaves in the worker step that queued the request (handshake cached by a warm-up)
# and crosses one local socket: well under this, which only covers the /metrics scrape's lag.
_PUSH_REQUEST_S = 0.2


def assert_transfer_id_flow_matches(reference, prefill_server, decode_server, prompts, d_first: bool = False, p_tp=1, d_tp=1):
    """Greedy output equals colocated for every prompt sent the transfer-id way; D loaded each
    prompt, P pushed each (layer-wise when D asked first) and freed every block. p_tp, d_tp: the
    TP sizes (D's rank 0 loads from each P rank holding its heads; P's rank 0 writes each D rank
    reading it); returns P rank 0's layer-wise pushes per reading D rank."""
    loads = len(source_ranks(TINY_KV_HEADS, p_tp, d_tp, 0))  # per prompt, D's rank 0
    writes = reader_count(TINY_KV_HEADS, p_tp, d_tp, 0)  # per prompt, P's rank 0
    if d_first:  # D hand-shakes with P now, so that no prompt's push request waits for a handshake
        transfer_id_generate(prefill_server, decode_server, prompts[0], 1)
        wait_until(lambda: stats(prefill_server).held_blocks == 0, 10, "P to free the warm-up's blocks")
    p0, d0 = stats(prefill_server), stats(decode_server)
    for prompt in prompts:
        p_resp, d_resp = transfer_id_generate(prefill_server, decode_server, prompt, MAX_TOKENS, d_first)
        assert p_resp.status_code == 200, p_resp.text[:300]
        assert output_ids(d_resp) == output_ids(generate(reference.url, prompt, MAX_TOKENS)), len(prompt)
    d1 = stats(decode_server)
    assert d1.recv_transfers - d0.recv_transfers == len(prompts) * loads, "D did not load every prompt from P"
    assert d1.recv_failures == d0.recv_failures
    wait_until(lambda: stats(prefill_server).held_blocks == 0, 10, "P to free the blocks it pushed")
    p1 = stats(prefill_server)
    assert p1.pushes - p0.pushes == len(prompts) * writes and p1.push_failures == p0.push_failures
    assert p1.expired_leases == p0.expired_leases
    if d_first:
        layerwise = p1.layerwise_pushes - p0.layerwise_pushes
        assert layerwise == len(prompts) * writes, "D asked first, yet P did not push layer-wise"
    return (p1.layerwise_pushes - p0.layerwise_pushes) // writes
