"""1P1D over our Mooncake connector (push: P batch-writes into D's blocks) with real vLLM servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvc_testing.cluster import (
    MOONCAKE_ENTRY_POINT_FORM,
    MOONCAKE_MODULE_FORM,
    ProxyProcess,
    pd_server,
)
from kvc_testing.procs import VllmServer, running
from tests.e2e.checks import (
    PROMPTS,
    assert_dead_producer_fails_fast,
    assert_foreign_kv_changes_output,
    assert_push_matches_colocated,
    assert_transfer_id_flow_matches,
    fresh_prompts,
)
from tests.e2e.conftest import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def mc_pair(tiny_model, perturbed_model, mooncake_prefill) -> Iterator[tuple[VllmServer, ...]]:
    """The session's P over Mooncake; D, and the producers two tests need (perturbed K/V weights; one
    they kill), started together."""
    decode = pd_server(
        tiny_model,
        "kv_consumer",
        form=MOONCAKE_ENTRY_POINT_FORM,
        name="D-mooncake",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"transfer_timeout_s": 10},
    )
    perturbed = pd_server(
        perturbed_model, "kv_producer", form=MOONCAKE_MODULE_FORM, name="P-mooncake-perturbed", max_model_len=MAX_MODEL_LEN
    )
    doomed = pd_server(tiny_model, "kv_producer", form=MOONCAKE_MODULE_FORM, name="P-mooncake-killed", max_model_len=MAX_MODEL_LEN)
    with running(decode, perturbed, doomed):
        yield mooncake_prefill, decode, perturbed, doomed


@pytest.fixture(scope="module")
def mc_prefill(mc_pair) -> VllmServer:
    return mc_pair[0]


@pytest.fixture(scope="module")
def mc_decode(mc_pair) -> VllmServer:
    return mc_pair[1]


@pytest.fixture(scope="module")
def mc_proxy(mc_prefill, mc_decode) -> Iterator[ProxyProcess]:
    with ProxyProcess([mc_prefill.url], [mc_decode.url]) as p:
        p.wait_ready()
        yield p


def test_mooncake_push_greedy_equals_colocated(reference, mc_prefill, mc_decode, mc_proxy):
    assert_push_matches_colocated(reference, mc_prefill, mc_decode, mc_proxy)


def test_mooncake_transfer_id_flow_through_proxy_and_layerwise_push(reference, mc_prefill, mc_decode):
    """The proxy sends P and D at once with a transfer id (Mooncake-style); then D first, so P
    writes layer by layer."""
    with ProxyProcess(
        [mc_prefill.url],
        [mc_decode.url],
        prefill_side_channels=[mc_prefill.side_channel_port],
        extra_args=["--flow", "transfer-id"],
    ) as proxy:
        proxy.wait_ready()
        assert_push_matches_colocated(reference, mc_prefill, mc_decode, proxy, prompts=fresh_prompts(12))
    assert_transfer_id_flow_matches(reference, mc_prefill, mc_decode, PROMPTS[-4:], d_first=True)


def test_mooncake_foreign_kv_changes_decode_output(reference, mc_pair, mc_decode):
    assert_foreign_kv_changes_output(reference, mc_pair[2], mc_decode)


def test_mooncake_producer_killed_fails_fast_and_decode_keeps_serving(reference, mc_pair, mc_prefill, mc_decode):
    assert_dead_producer_fails_fast(reference, mc_pair[3], mc_prefill, mc_decode)
