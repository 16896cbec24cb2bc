"""P and D with different --block-size (32 and 64 tokens, both directions) with real vLLM servers:
the prompt's tokens are mapped through both block tables (partial last blocks, D's own prefix-cache
hits): D reading over NIXL, P writing over Mooncake, and P writing layer by layer in the
transfer-id flow."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvc_testing.cluster import (
    ENTRY_POINT_FORM,
    MODULE_FORM,
    MOONCAKE_MODULE_FORM,
    ProxyProcess,
    generate,
    make_prompts,
    output_ids,
    pd_server,
    prefill,
    stats,
)
from kvc_testing.procs import VllmServer, running
from tests.e2e.checks import (
    MAX_TOKENS,
    assert_pd_matches_colocated,
    assert_push_matches_colocated,
    assert_transfer_id_flow_matches,
    fresh_prompts,
)
from tests.e2e.conftest import MAX_MODEL_LEN

HANDSHAKE_S = 5.0


@pytest.fixture(scope="module")
def block64(tiny_model) -> Iterator[tuple[VllmServer, ...]]:
    """P and D with 64-token blocks, a pushing D with 32-token ones, and this module's own P and D with
    32-token blocks (below), started together."""
    p64 = pd_server(tiny_model, "kv_producer", name="P-block64", max_model_len=MAX_MODEL_LEN, block_size=64)
    d64 = pd_server(
        tiny_model,
        "kv_consumer",
        name="D-block64",
        max_model_len=MAX_MODEL_LEN,
        block_size=64,
        extra_config={"handshake_timeout_s": HANDSHAKE_S, "transfer_timeout_s": 10},
    )
    push32 = pd_server(
        tiny_model,
        "kv_consumer",
        name="D-push-block32",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"mode": "push", "handshake_timeout_s": HANDSHAKE_S, "transfer_timeout_s": 10},
    )
    p32 = pd_server(tiny_model, "kv_producer", form=MODULE_FORM, name="P-block32", max_model_len=MAX_MODEL_LEN)
    d32 = pd_server(
        tiny_model,
        "kv_consumer",
        form=ENTRY_POINT_FORM,
        name="D-block32",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"handshake_timeout_s": HANDSHAKE_S, "transfer_timeout_s": 10},
    )
    with running(p64, d64, push32, p32, d32) as servers:
        yield servers


# This module's 32-token-block P and D instead of the session's: a server that read from a peer of
# another block size and then wrote to it layer by layer (each a transfer of ~2000 descriptors) has
# been seen to keep one NIXL UCX progress thread busy for good (a core; with nixl_num_threads 0, not),
# and the session's then had to be restarted.
@pytest.fixture(scope="module")
def prefill_server(block64) -> VllmServer:
    return block64[3]


@pytest.fixture(scope="module")
def decode_server(block64) -> VllmServer:
    return block64[4]


@pytest.fixture(scope="module")
def p64(block64) -> VllmServer:
    return block64[0]


@pytest.fixture(scope="module")
def d64(block64) -> VllmServer:
    return block64[1]


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


def test_mooncake_push_between_block_sizes(reference, tiny_model, mooncake_prefill):
    """Mooncake's default mode: P (32-token blocks) writes the tokens D (64-token blocks) names."""
    mc = {"handshake_timeout_s": HANDSHAKE_S, "transfer_timeout_s": 10}
    p = mooncake_prefill
    d = pd_server(
        tiny_model,
        "kv_consumer",
        form=MOONCAKE_MODULE_FORM,
        name="D-mc-block64",
        max_model_len=MAX_MODEL_LEN,
        block_size=64,
        extra_config=mc,
    )
    with d, ProxyProcess([p.url], [d.url]) as proxy:
        proxy.wait_ready()
        assert_push_matches_colocated(reference, p, d, proxy, prompts=fresh_prompts(45))


def test_nixl_push_from_block64_into_block32(reference, block64):
    """D (32-token blocks) asks P (64-token blocks) to write: P maps the tokens D names into D's blocks."""
    p64, d = block64[0], block64[2]
    with ProxyProcess([p64.url], [d.url]) as proxy:
        proxy.wait_ready()
        assert_push_matches_colocated(reference, p64, d, proxy, prompts=fresh_prompts(47))


def test_transfer_id_flow_from_block32_into_block64_with_layerwise_push(reference, prefill_server, d64):
    """P and D at once, D first: P (32-token blocks) writes each layer's tokens into D's 64-token blocks."""
    prompts = fresh_prompts(48)[-4:]
    assert assert_transfer_id_flow_matches(reference, prefill_server, d64, prompts, d_first=True) == len(prompts)


def test_transfer_id_flow_between_block_sizes_with_layerwise_push(reference, p64, decode_server):
    """P and D at once, D first: P (64-token blocks) writes each layer's tokens into D's
    32-token blocks as soon as the layer is computed, without D ever knowing P's blocks."""
    prompts = fresh_prompts(46)[-4:]
    assert assert_transfer_id_flow_matches(reference, p64, decode_server, prompts, d_first=True) == len(prompts)
