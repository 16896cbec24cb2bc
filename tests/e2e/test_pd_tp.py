"""Tensor parallelism with real vLLM servers: P and D at TP 2 (a worker process per rank, one core
each), each decode rank loading its KV heads from the prefill rank of its number; a decode instance
of another TP size is refused per request, fast, and keeps serving."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvc_testing.cluster import ENTRY_POINT_FORM, MODULE_FORM, ProxyProcess, generate, output_ids, pd_server, prefill, stats
from kvc_testing.procs import VllmServer
from tests.e2e.checks import (
    MAX_TOKENS,
    PROMPTS,
    assert_foreign_kv_changes_output,
    assert_pd_matches_colocated,
    assert_transfer_id_flow_matches,
    fresh_prompts,
)
from tests.e2e.conftest import MAX_MODEL_LEN

TP = 2
HANDSHAKE_S = 5.0


@pytest.fixture(scope="module")
def tp_prefill(tiny_model) -> Iterator[VllmServer]:
    server = pd_server(tiny_model, "kv_producer", form=MODULE_FORM, name="P-tp2", max_model_len=MAX_MODEL_LEN, tp=TP)
    with server:
        yield server


@pytest.fixture(scope="module")
def tp_decode(tiny_model) -> Iterator[VllmServer]:
    server = pd_server(
        tiny_model,
        "kv_consumer",
        form=ENTRY_POINT_FORM,
        name="D-tp2",
        max_model_len=MAX_MODEL_LEN,
        tp=TP,
        extra_config={"handshake_timeout_s": HANDSHAKE_S, "transfer_timeout_s": 10},
    )
    with server:
        yield server


def test_tp2_pull_through_the_proxy_equals_colocated(reference, tp_prefill, tp_decode):
    """Both ranks of D load every prompt from P's rank of their number; output equals a colocated
    TP 1 server token for token (a rank reading the other rank's heads would change it)."""
    with ProxyProcess([tp_prefill.url], [tp_decode.url]) as proxy:
        proxy.wait_ready()
        assert_pd_matches_colocated(reference, tp_prefill, tp_decode, proxy, tp=TP)


def test_tp2_transfer_id_flow_with_layerwise_push(reference, tp_prefill, tp_decode):
    """P and D at once with a transfer id, D first: each P rank writes its heads, layer by layer,
    into D's rank of its number."""
    prompts = fresh_prompts(21)[-4:]
    layerwise = assert_transfer_id_flow_matches(reference, tp_prefill, tp_decode, prompts, d_first=True)
    assert layerwise == len(prompts)
    assert stats(tp_prefill, rank=1).layerwise_pushes >= len(prompts), "P rank 1 did not push layer-wise"


def test_tp2_foreign_kv_changes_decode_output(reference, perturbed_model, tp_decode):
    server = pd_server(perturbed_model, "kv_producer", name="P-tp2-perturbed", max_model_len=MAX_MODEL_LEN, tp=TP)
    with server:
        assert_foreign_kv_changes_output(reference, server, tp_decode)


def test_decode_of_another_tp_size_is_refused_fast_and_keeps_serving(tiny_model, reference, tp_prefill):
    """D at TP 1 given a TP 2 prefill's params: refused at once naming both sizes (the params state
    P's size), and in the transfer-id flow by P's handshake within the handshake deadline; D
    serves the next request."""
    d1 = pd_server(
        tiny_model,
        "kv_consumer",
        name="D-tp1",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"handshake_timeout_s": HANDSHAKE_S, "transfer_timeout_s": 10},
    )
    with d1:
        prompt = PROMPTS[10]
        params = prefill(tp_prefill.url, prompt)
        t0 = time.monotonic()
        r = generate(d1.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=60)
        assert time.monotonic() - t0 < HANDSHAKE_S
        assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:300]
        d1.wait_log("tensor_parallel_size 2, this decode instance 1", 10)

        p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "kvc-tp-mismatch"}
        d_params = {**p_params, "do_remote_decode": False, "do_remote_prefill": True}
        d_params |= {"remote_host": "127.0.0.1", "remote_port": tp_prefill.side_channel_port}
        assert generate(tp_prefill.url, prompt, 1, kv_transfer_params=p_params).status_code == 200
        t0 = time.monotonic()
        r = generate(d1.url, prompt, MAX_TOKENS, kv_transfer_params=d_params, timeout=60)
        assert time.monotonic() - t0 < HANDSHAKE_S + 5
        assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:300]
        d1.wait_log("rank 0 of tensor_parallel_size 2, client rank 0 of 1", 10)
        assert stats(d1).recv_failures == 2

        expected = output_ids(generate(reference.url, PROMPTS[3], MAX_TOKENS))
        assert output_ids(generate(d1.url, PROMPTS[3], MAX_TOKENS)) == expected
