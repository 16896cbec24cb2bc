"""1P1D over our Mooncake connector (push: P batch-writes into D's blocks) with real vLLM servers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kv_connectors.testing.cluster import (
    MOONCAKE_ENTRY_POINT_FORM, MOONCAKE_MODULE_FORM, ProxyProcess, generate, output_ids, pd_server, prefill, stats,
    wait_until,
)
from kv_connectors.testing.procs import VllmServer
from tests.e2e.checks import MAX_TOKENS, PROMPTS, assert_pd_matches_colocated
from tests.e2e.conftest import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def mc_prefill(tiny_model) -> Iterator[VllmServer]:
    server = pd_server(tiny_model, "kv_producer", form=MOONCAKE_MODULE_FORM, name="P-mooncake",
                       max_model_len=MAX_MODEL_LEN)
    with server:
        yield server


@pytest.fixture(scope="module")
def mc_decode(tiny_model) -> Iterator[VllmServer]:
    server = pd_server(tiny_model, "kv_consumer", form=MOONCAKE_ENTRY_POINT_FORM, name="D-mooncake",
                       max_model_len=MAX_MODEL_LEN, extra_config={"transfer_timeout_s": 10})
    with server:
        yield server


@pytest.fixture(scope="module")
def mc_proxy(mc_prefill, mc_decode) -> Iterator[ProxyProcess]:
    with ProxyProcess([mc_prefill.url], [mc_decode.url]) as p:
        p.wait_ready()
        yield p


def test_mooncake_push_greedy_equals_colocated(reference, mc_prefill, mc_decode, mc_proxy):
    p0 = stats(mc_prefill)
    assert_pd_matches_colocated(reference, mc_prefill, mc_decode, mc_proxy)
    assert stats(mc_prefill).pushes - p0.pushes == len(PROMPTS), "P did not write the blocks"


def test_mooncake_foreign_kv_changes_decode_output(reference, perturbed_model, mc_decode):
    server = pd_server(perturbed_model, "kv_producer", form=MOONCAKE_MODULE_FORM, name="P-mooncake-perturbed",
                       max_model_len=MAX_MODEL_LEN)
    with server:
        prompts = PROMPTS[8:16]
        changed = 0
        for prompt in prompts:
            params = prefill(server.url, prompt)
            got = output_ids(generate(mc_decode.url, prompt, MAX_TOKENS, kv_transfer_params=params))
            changed += got != output_ids(generate(reference.url, prompt, MAX_TOKENS))
        # Without a transfer D would recompute and match the reference on every prompt.
        assert changed >= len(prompts) // 2, f"only {changed}/{len(prompts)} outputs changed with foreign KV"
        wait_until(lambda: stats(server).held_blocks == 0, 10, "perturbed P to free its blocks")


def test_mooncake_producer_killed_fails_fast_and_decode_keeps_serving(tiny_model, reference, mc_prefill, mc_decode):
    producer = pd_server(tiny_model, "kv_producer", form=MOONCAKE_MODULE_FORM, name="P-mooncake-killed",
                         max_model_len=MAX_MODEL_LEN)
    with producer:
        params = prefill(producer.url, PROMPTS[9])
        producer.stop()
    d0 = stats(mc_decode)
    t0 = time.monotonic()
    r = generate(mc_decode.url, PROMPTS[9], MAX_TOKENS, kv_transfer_params=params, timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:300]
    assert stats(mc_decode).recv_failures == d0.recv_failures + 1
    prompt = PROMPTS[11]
    params = prefill(mc_prefill.url, prompt)
    got = output_ids(generate(mc_decode.url, prompt, MAX_TOKENS, kv_transfer_params=params))
    assert got == output_ids(generate(reference.url, prompt, MAX_TOKENS))
    wait_until(lambda: stats(mc_prefill).held_blocks == 0, 10, "P to free the blocks")
