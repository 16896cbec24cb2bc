"""P and D with different --block-size (32 and 64 tokens, both directions) with real vLLM servers:
D maps the prompt's tokens through both block tables (partial last blocks, D's own prefix-cache
hits), over NIXL and over Mooncake (pull); push with different block sizes fails fast."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvc_testing.cluster import (
    MOONCAKE_MODULE_FORM,
    ProxyProcess,
    generate,
    make_prompts,
    output_ids,
    pd_server,
    prefill,
    stats,
    transfer_id_params,
    wait_until,
)
from kvc_testing.procs import VllmServer
from tests.e2e.checks import MAX_TOKENS, assert_pd_matches_colocated, fresh_prompts
from tests.e2e.conftest import MAX_MODEL_LEN

HANDSHAKE_S = 5.0


@pytest.fixture(scope="module")
def p64(tiny_model) -> Iterator[VllmServer]:
    with pd_server(tiny_model, "kv_producer", name="P-block64", max_model_len=MAX_MODEL_LEN, block_size=64) as server:
        yield server


@pytest.fixture(scope="module")
def d64(tiny_model) -> Iterator[VllmServer]:
    server = pd_server(
        tiny_model,
        "kv_consumer",
        name="D-block64",
        max_model_len=MAX_MODEL_LEN,
        block_size=64,
        extra_config={"handshake_timeout_s": HANDSHAKE_S, "transfer_timeout_s": 10},
    )
    with server:
        yield server


def test_prefill_block32_to_decode_block64_through_the_proxy(reference, prefill_server, d64):
    with ProxyProcess([prefill_server.url], [d64.url]) as proxy:
        proxy.wait_ready()
        assert_pd_matches_colocated(reference, prefill_server, d64, proxy, prompts=fresh_prompts(41))


def test_prefill_block64_to_decode_block32_through_the_proxy(reference, p64, decode_server):
    with ProxyProcess([p64.url], [decode_server.url]) as proxy:
        proxy.wait_ready()
        assert_pd_matches_colocated(reference, p64, decode_server, proxy, prompts=fresh_prompts(42))


def test_decode_prefix_hit_loads_only_the_tokens_it_lacks(reference, prefill_server, d64):
    """A second turn extends the first: D (64-token blocks) has the first turn's whole blocks
    cached and loads the rest from P (32-token blocks), starting inside P's block list."""
    first = make_prompts([200], seed=43)[0]
    second = first + make_prompts([100], seed=44)[0]
    for prompt in (first, second):
        d0 = stats(d64)
        params = prefill(prefill_server.url, prompt)
        got = output_ids(generate(d64.url, prompt, MAX_TOKENS, kv_transfer_params=params))
        assert got == output_ids(generate(reference.url, prompt, MAX_TOKENS)), len(prompt)
        d1 = stats(d64)
        assert d1.recv_transfers == d0.recv_transfers + 1 and d1.recv_failures == d0.recv_failures
    # 300 tokens fill 5 blocks of 64; the first turn left 3 whole blocks (192 tokens) cached.
    assert d1.recv_blocks - d0.recv_blocks == 2, "D loaded blocks it had cached"


def test_mooncake_pull_between_block_sizes(reference, tiny_model):
    mc = {"mode": "pull", "handshake_timeout_s": HANDSHAKE_S, "transfer_timeout_s": 10}
    p = pd_server(tiny_model, "kv_producer", form=MOONCAKE_MODULE_FORM, name="P-mc-block32", max_model_len=MAX_MODEL_LEN)
    d = pd_server(
        tiny_model,
        "kv_consumer",
        form=MOONCAKE_MODULE_FORM,
        name="D-mc-block64",
        max_model_len=MAX_MODEL_LEN,
        block_size=64,
        extra_config=mc,
    )
    with p, d, ProxyProcess([p.url], [d.url]) as proxy:
        proxy.wait_ready()
        assert_pd_matches_colocated(reference, p, d, proxy, prompts=fresh_prompts(45))


def test_push_between_block_sizes_fails_fast_and_decode_keeps_serving(reference, prefill_server, d64):
    """The transfer-id flow is push only: P cannot write 32-token blocks into 64-token ones yet."""
    prompt = fresh_prompts(46)[12]
    p_params, d_params = transfer_id_params(prefill_server)
    assert generate(prefill_server.url, prompt, 1, kv_transfer_params=p_params).status_code == 200
    t0 = time.monotonic()
    r = generate(d64.url, prompt, MAX_TOKENS, kv_transfer_params=d_params, timeout=60)
    assert time.monotonic() - t0 < HANDSHAKE_S + 5
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:300]
    d64.wait_log("different block sizes are served in pull mode", 10)
    wait_until(lambda: stats(prefill_server).held_blocks == 0, 10, "P to free the blocks D told it it will not load")
    params = prefill(prefill_server.url, prompt)
    got = output_ids(generate(d64.url, prompt, MAX_TOKENS, kv_transfer_params=params))
    assert got == output_ids(generate(reference.url, prompt, MAX_TOKENS))
