"""The transfer-id flow (P and D sent at once, as with Mooncake-style proxies) and layer-wise push,
with real vLLM servers over NIXL."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvc_testing.cluster import ProxyProcess, generate, make_prompts, output_ids, stats, transfer_id_params, wait_until
from tests.e2e.checks import (
    MAX_TOKENS,
    PROMPTS,
    assert_pd_matches_colocated,
    assert_transfer_id_flow_matches,
    fresh_prompts,
    transfer_id_generate,
)


@pytest.fixture(scope="module")
def tid_proxy(prefill_server, decode_server) -> Iterator[ProxyProcess]:
    """The example proxy in its transfer-id flow: it knows P's side channel and sends P and D at once."""
    with ProxyProcess(
        [prefill_server.url],
        [decode_server.url],
        prefill_side_channels=[prefill_server.side_channel_port],
        extra_args=["--flow", "transfer-id"],
    ) as p:
        p.wait_ready()
        yield p


def test_transfer_id_flow_through_proxy_greedy_equals_colocated(reference, prefill_server, decode_server, tid_proxy):
    """D is a pull-mode consumer: for a transfer-id request it still asks P to push (P's blocks are unknown)."""
    p0 = stats(prefill_server)
    sent = assert_pd_matches_colocated(reference, prefill_server, decode_server, tid_proxy, prompts=fresh_prompts(11))
    p1 = stats(prefill_server)
    assert p1.pushes - p0.pushes == sent, "P did not push every prompt"
    print(f"layer-wise pushes when sent at once: {p1.layerwise_pushes - p0.layerwise_pushes}/{sent}")


def test_transfer_id_flow_without_proxy(reference, prefill_server, decode_server):
    """The bare protocol, as any Mooncake-style proxy speaks it."""
    assert_transfer_id_flow_matches(reference, prefill_server, decode_server, PROMPTS[::4])


def test_layerwise_push_when_decode_asks_first(reference, prefill_server, decode_server):
    """D's push request is at P before P computes: every layer is written as soon as it is computed."""
    assert_transfer_id_flow_matches(reference, prefill_server, decode_server, PROMPTS[-6:], d_first=True)


def test_decode_whose_prefill_never_comes_fails_within_deadline(reference, prefill_server, decode_server):
    """D waits for a P that never gets the request: it fails that request by its deadline (10 s here),
    P drops the push request, and both keep serving."""
    d0 = stats(decode_server)
    prompt = PROMPTS[12]
    t0 = time.monotonic()
    _p_params, d_params = transfer_id_params(prefill_server, "kvc-never-prefilled")
    r = generate(decode_server.url, prompt, MAX_TOKENS, kv_transfer_params=d_params, timeout=60)
    assert time.monotonic() - t0 < 25
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:300]
    assert stats(decode_server).recv_failures == d0.recv_failures + 1
    p_resp, d_resp = transfer_id_generate(prefill_server, decode_server, prompt, MAX_TOKENS)
    assert p_resp.status_code == 200
    assert output_ids(d_resp) == output_ids(generate(reference.url, prompt, MAX_TOKENS))
    wait_until(lambda: stats(prefill_server).held_blocks == 0, 10, "P to free the blocks")


def test_decode_prompt_other_than_the_prefills_is_refused_under_one_transfer_id(reference, prefill_server, decode_server):
    """A router that pairs two prompts under one transfer id (an id reused, or two colliding): P
    prefilled A, then D asks for the id with prompt B of the same length. P must not write A's KV
    into B's request (D would answer 200 with tokens computed from A's KV): the push is refused and
    D fails the request. A D request with A then matches colocated or fails cleanly."""
    (a,), (b,) = make_prompts([200], seed=71), make_prompts([200], seed=72)
    p_params, d_params = transfer_id_params(prefill_server)
    p0, d0 = stats(prefill_server), stats(decode_server)
    assert generate(prefill_server.url, a, 1, kv_transfer_params=p_params).status_code == 200
    r = generate(decode_server.url, b, MAX_TOKENS, kv_transfer_params=d_params, timeout=60)
    if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] != "error":
        assert output_ids(r) == output_ids(generate(reference.url, b, MAX_TOKENS)), "D answered B from A's KV"
    p1, d1 = stats(prefill_server), stats(decode_server)
    assert p1.push_failures == p0.push_failures + 1 and p1.pushes == p0.pushes, "P wrote A's KV for B"
    assert d1.recv_failures == d0.recv_failures + 1
    # vLLM releases a failed request's remote blocks through a stand-in request without its prompt,
    # so P may have freed the lease: the D request with A is then refused, never answered wrongly.
    r = generate(decode_server.url, a, MAX_TOKENS, kv_transfer_params=d_params, timeout=60)
    if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] != "error":
        assert output_ids(r) == output_ids(generate(reference.url, a, MAX_TOKENS))
    wait_until(lambda: stats(prefill_server).held_blocks == 0, 10, "P to free the blocks")
