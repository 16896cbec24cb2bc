"""Stale-read drill (real vLLM): D gets P's kv_transfer_params only after P's lease expired and
other prompts reused every block P held. D must fail the request (policy fail) or recompute it
(policy recompute): never answer 200 with tokens computed from another prompt's KV."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from kvc_testing.cluster import (
    generate,
    make_prompts,
    output_ids,
    pd_server,
    prefill,
    stats,
    transfer_id_params,
    wait_until,
)
from kvc_testing.procs import running
from tests.e2e.checks import MAX_TOKENS
from tests.e2e.conftest import MAX_MODEL_LEN

LEASE_S = 2.0
# The tiny model's KV is 1 KiB per token (2 layers x 2 KV heads x 64 values x 4 bytes): 32 KiB per
# 32-token block, so 1 MiB is 32 blocks and two 480-token prompts reuse every one of them.
SMALL_KV_BYTES = 1024 * 1024
FILLER = make_prompts([480, 480, 480], seed=77)
PROMPTS = make_prompts([200, 300, 150], seed=78)


@pytest.fixture(scope="module")
def stale_servers(tiny_model):
    """P with a short lease and a small cache, a D recomputing failed loads and a D running one request
    at a time: started together."""
    short_lease = pd_server(
        tiny_model,
        "kv_producer",
        name="P-short-lease",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=SMALL_KV_BYTES,
        extra_config={"lease_s": LEASE_S},
    )
    recompute = pd_server(
        tiny_model,
        "kv_consumer",
        name="D-recompute-stale",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"handshake_timeout_s": 5, "transfer_timeout_s": 10},
        transfer_config={"kv_load_failure_policy": "recompute"},
    )
    one_seq = pd_server(
        tiny_model,
        "kv_consumer",
        name="D-one-seq",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"handshake_timeout_s": 5, "transfer_timeout_s": 10},
    )
    one_seq.argv += ["--max-num-seqs", "1"]
    with running(short_lease, recompute, one_seq) as servers:
        yield servers


@pytest.fixture(scope="module")
def short_lease_prefill(stale_servers):
    return stale_servers[0]


@pytest.fixture(scope="module")
def recompute_decode(stale_servers):
    return stale_servers[1]


def _stale_params(producer, prompt) -> dict:
    """P's params for prompt, after the lease expired and other prompts overwrote every block."""
    params = prefill(producer.url, prompt)
    expired = stats(producer).expired_leases
    wait_until(lambda: stats(producer).expired_leases > expired, 15, "P's lease to expire")
    for filler in FILLER:  # plain requests on P: they allocate (and overwrite) every free block
        output_ids(generate(producer.url, filler, 1))
    return params


def _failed(response) -> bool:
    return response.status_code != 200 or response.json()["choices"][0]["finish_reason"] == "error"


def test_stale_read_fails_with_policy_fail(reference, short_lease_prefill, decode_server):
    for prompt in PROMPTS:
        expected = output_ids(generate(reference.url, prompt, MAX_TOKENS))
        params = _stale_params(short_lease_prefill, prompt)
        d0 = stats(decode_server)
        r = generate(decode_server.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=60)
        if r.status_code == 200 and not _failed(r):
            got = list(r.json()["choices"][0]["token_ids"])
            assert got == expected, f"stale read served wrong tokens with HTTP 200 (length {len(prompt)})"
            pytest.fail(f"a stale read was served (tokens happened to match, length {len(prompt)})")
        assert stats(decode_server).recv_failures == d0.recv_failures + 1
    # The same requests read in time are exact: the drill's prompts and P are fine.
    prompt = make_prompts([250], seed=79)[0]
    params = prefill(short_lease_prefill.url, prompt)
    got = output_ids(generate(decode_server.url, prompt, MAX_TOKENS, kv_transfer_params=params))
    assert got == output_ids(generate(reference.url, prompt, MAX_TOKENS))
    wait_until(lambda: stats(short_lease_prefill).held_blocks == 0, 10, "P to free its blocks")


def test_stale_read_recomputes_with_policy_recompute(reference, short_lease_prefill, recompute_decode):
    prompts = make_prompts([210, 310], seed=80)
    for prompt in prompts:
        expected = output_ids(generate(reference.url, prompt, MAX_TOKENS))
        params = _stale_params(short_lease_prefill, prompt)
        d0 = stats(recompute_decode)
        got = output_ids(generate(recompute_decode.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=60))
        assert got == expected, f"stale read served wrong tokens (length {len(prompt)})"
        d1 = stats(recompute_decode)
        assert d1.recv_failures == d0.recv_failures + 1, "D recomputed nothing: it loaded the stale KV"
        assert d1.recv_transfers == d0.recv_transfers


def test_late_push_request_to_an_idle_producer_fails_at_once(reference, short_lease_prefill, decode_server):
    """The transfer-id flow, D late: P's lease under T expired and P has nothing left to do, so its
    engine does not step. D's push request is refused in P's answer to it: the request fails well
    before D's 10 s transfer deadline (it used to wait it out), and is never served from other KV."""
    (prompt,) = make_prompts([230], seed=81)
    p_params, d_params = transfer_id_params(short_lease_prefill)
    expired = stats(short_lease_prefill).expired_leases
    assert generate(short_lease_prefill.url, prompt, 1, kv_transfer_params=p_params).status_code == 200
    wait_until(lambda: stats(short_lease_prefill).expired_leases > expired, 15, "P's lease to expire")
    d0 = stats(decode_server)
    t0 = time.monotonic()
    r = generate(decode_server.url, prompt, MAX_TOKENS, kv_transfer_params=d_params, timeout=60)
    elapsed = time.monotonic() - t0
    assert _failed(r), "D was served KV under a lease that had expired"
    assert stats(decode_server).recv_failures == d0.recv_failures + 1
    assert elapsed < 5.0, f"D waited {elapsed:.1f} s for a producer that had freed the blocks"


@pytest.fixture(scope="module")
def one_seq_decode(stale_servers):
    """A D that runs one request at a time: others wait in its queue."""
    return stale_servers[2]


def test_heartbeats_keep_the_kv_of_a_request_queued_for_3x_the_lease(reference, short_lease_prefill, one_seq_decode):
    prompt = make_prompts([230], seed=81)[0]
    expected = output_ids(generate(reference.url, prompt, MAX_TOKENS))
    fillers = make_prompts([8] * 12, seed=82)
    p0, d0 = stats(short_lease_prefill), stats(one_seq_decode)
    with concurrent.futures.ThreadPoolExecutor(len(fillers) + 1) as pool:
        # D busy with long generations, one at a time: the PD request waits behind them.
        busy = [pool.submit(generate, one_seq_decode.url, f, MAX_MODEL_LEN - 16, 300, ignore_eos=True) for f in fillers]
        time.sleep(0.5)
        # As a proxy does: D gets the request as soon as P answered (P's lease starts there).
        params = prefill(short_lease_prefill.url, prompt)
        t0 = time.monotonic()
        r = pool.submit(generate, one_seq_decode.url, prompt, MAX_TOKENS, 300, kv_transfer_params=params).result()
        waited = time.monotonic() - t0
        for f in busy:
            assert f.result().status_code == 200
    assert waited >= 3 * LEASE_S, f"the drill's request waited only {waited:.1f} s (< 3x the {LEASE_S:g} s lease)"
    assert output_ids(r) == expected, "D's output differs from colocated"
    d1 = stats(one_seq_decode)
    assert d1.recv_transfers == d0.recv_transfers + 1 and d1.recv_failures == d0.recv_failures, (
        "D did not load P's KV (recomputed or failed)"
    )
    assert d1.lease_renewals > d0.lease_renewals
    wait_until(lambda: stats(short_lease_prefill).held_blocks == 0, 10, "P to free its blocks")
    p1 = stats(short_lease_prefill)
    assert p1.expired_leases == p0.expired_leases and p1.completed_sends == p0.completed_sends + 1
