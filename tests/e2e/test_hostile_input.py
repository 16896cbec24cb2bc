"""Hostile input against live servers: a fuzz of P's and D's side channels (random and mutated
frames, wrong hash, oversize frames, empty pushes, unknown keys, impossible ids), and of
kv_transfer_params through D's HTTP API. Every bad request gets an error; afterwards both serve
greedy-exact requests, memory stays bounded and P holds no blocks."""

from __future__ import annotations

import random

import pytest

from kvc_testing.cluster import generate, make_prompts, output_ids, prefill, stats, wait_until
from kvc_testing.fuzz import fuzz
from tests.e2e.checks import MAX_TOKENS

FUZZ_MESSAGES = 2500
RSS_GROWTH_LIMIT = 256 * 1024 * 1024


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
        counts = fuzz(server.side_channel_port, rng, FUZZ_MESSAGES)
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
