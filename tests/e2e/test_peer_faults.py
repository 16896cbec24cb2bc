"""Unkind peers with real vLLM servers: a frozen P delays only its own requests (2P1D), and a P
restarted on the same address and engine id is a new peer (re-handshake, never a read of the new
process with the old one's descriptors)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import statistics
import time

import pytest

from kvc_testing.cluster import generate, make_prompts, output_ids, pd_server, prefill, stats, wait_until
from kvc_testing.procs import free_port
from tests.e2e.checks import MAX_TOKENS, transfer_id_generate
from tests.e2e.conftest import D_HANDSHAKE_S, MAX_MODEL_LEN

FROZEN_REQUESTS = 3  # each would hold a shared side-channel thread for D's 5 s handshake deadline
# A healthy request held behind the frozen P's handshakes would end only at their deadline (the
# first starts 0.5 s after them): each healthy one must end well before it. An absolute bound, not
# a ratio to the healthy latency before: a busy 2-core host moves that ratio by itself.
HEALTHY_BOUND_S = 0.6 * D_HANDSHAKE_S


@pytest.fixture(scope="module")
def doomed_prefill(tiny_model):
    server = pd_server(tiny_model, "kv_producer", name="P-frozen", max_model_len=MAX_MODEL_LEN)
    with server:
        yield server


def _timed_decode(decode_server, prompt, params) -> tuple[float, list[int]]:
    t0 = time.monotonic()
    r = generate(decode_server.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=120)
    return time.monotonic() - t0, output_ids(r)


def _healthy_latencies(reference, prefill_server, decode_server, seed: int, n: int = 6) -> list[float]:
    out = []
    for prompt in make_prompts([150] * n, seed=seed):
        params = prefill(prefill_server.url, prompt)
        elapsed, got = _timed_decode(decode_server, prompt, params)
        assert got == output_ids(generate(reference.url, prompt, MAX_TOKENS))
        out.append(elapsed)
    return out


def test_frozen_producer_delays_only_its_own_requests(reference, prefill_server, decode_server, doomed_prefill):
    before = _healthy_latencies(reference, prefill_server, decode_server, seed=301)
    frozen_prompts = make_prompts([120] * FROZEN_REQUESTS, seed=302)
    frozen_params = [prefill(doomed_prefill.url, p) for p in frozen_prompts]
    os.killpg(doomed_prefill.pgid, signal.SIGSTOP)
    try:
        d0 = stats(decode_server)
        with concurrent.futures.ThreadPoolExecutor(FROZEN_REQUESTS) as pool:
            # D hand-shakes with the frozen P for these (never answered), while the healthy P serves.
            stuck = [
                pool.submit(generate, decode_server.url, p, MAX_TOKENS, 120, kv_transfer_params=params)
                for p, params in zip(frozen_prompts, frozen_params)
            ]
            time.sleep(0.5)
            during = _healthy_latencies(reference, prefill_server, decode_server, seed=303)
            t0 = time.monotonic()
            results = [f.result() for f in stuck]
            waited = time.monotonic() - t0
        for r in results:
            assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:300]
        assert waited < 30, f"requests to the frozen P took {waited:.0f} s more to fail"
        assert stats(decode_server).recv_failures == d0.recv_failures + FROZEN_REQUESTS
    finally:
        os.killpg(doomed_prefill.pgid, signal.SIGCONT)
    ratio = statistics.median(during) / statistics.median(before)
    print(
        f"\nfrozen P: healthy median {statistics.median(before) * 1e3:.0f} -> {statistics.median(during) * 1e3:.0f} ms "
        f"(ratio {ratio:.2f}, slowest {max(during) * 1e3:.0f} ms); {FROZEN_REQUESTS} requests to the frozen P failed "
        f"{waited:.1f} s after the healthy ones"
    )
    assert max(during) < HEALTHY_BOUND_S, (
        f"a healthy request took {max(during):.1f} s while a P was frozen (bound {HEALTHY_BOUND_S:.1f} s, D's handshake "
        f"deadline {D_HANDSHAKE_S} s): it waited behind the frozen P's requests; latencies {[round(x, 2) for x in during]}"
    )


def _restartable_prefill(tiny_model, http_port: int, side_channel_port: int):
    # The same engine id after the restart: the same peer key on D, whose handshake is cached.
    return pd_server(
        tiny_model,
        "kv_producer",
        name="P-restart",
        max_model_len=MAX_MODEL_LEN,
        side_channel_port=side_channel_port,
        port=http_port,
        transfer_config={"engine_id": "kvc-restartable-prefill"},
    )


def test_restarted_producer_on_the_same_address_is_a_new_peer(tiny_model, reference, decode_server):
    http_port, side_port = free_port(), free_port()
    first, second = make_prompts([140, 170, 110], seed=304)[:2], make_prompts([130], seed=305)[0]
    with _restartable_prefill(tiny_model, http_port, side_port) as p:
        for prompt in first:  # D hand-shakes with it and caches the handshake
            params = prefill(p.url, prompt)
            _elapsed, got = _timed_decode(decode_server, prompt, params)
            assert got == output_ids(generate(reference.url, prompt, MAX_TOKENS))
    with _restartable_prefill(tiny_model, http_port, side_port) as p:
        params = prefill(p.url, second)
        r = generate(decode_server.url, second, MAX_TOKENS, kv_transfer_params=params, timeout=60)
        expected = output_ids(generate(reference.url, second, MAX_TOKENS))
        if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] != "error":
            assert output_ids(r) == expected, "D read the restarted P with the old process's descriptors"
        else:  # a clean failure is allowed once; the next request must work
            params = prefill(p.url, second)
            assert output_ids(generate(decode_server.url, second, MAX_TOKENS, kv_transfer_params=params)) == expected
        wait_until(lambda: stats(p).held_blocks == 0, 15, "the restarted P to free its blocks")


def _served(response) -> bool:
    return response.status_code == 200 and response.json()["choices"][0]["finish_reason"] != "error"


def test_push_loads_recover_after_the_producer_restarts_on_the_same_address(tiny_model, reference, decode_server):
    """The transfer-id flow names no engine id, so D's cached handshake with P outlives P's restart.
    The new P cannot reach D (it never connected to it): its push answer's epoch tells D, which fails
    that load at once and hand-shakes again. Every later push load to it used to wait out D's
    transfer deadline (10 s here) and fail, until D itself restarted."""
    http_port, side_port = free_port(), free_port()
    warm, prompt = make_prompts([150], seed=306)[0], make_prompts([160], seed=307)[0]
    expected = output_ids(generate(reference.url, prompt, MAX_TOKENS))
    with _restartable_prefill(tiny_model, http_port, side_port) as p:
        p_resp, d_resp = transfer_id_generate(p, decode_server, warm, MAX_TOKENS)
        assert p_resp.status_code == 200 and _served(d_resp)  # D hand-shook with this P
    with _restartable_prefill(tiny_model, http_port, side_port) as p:
        t0 = time.monotonic()
        for _attempt in range(2):  # one clean failure is allowed: D learns of the restart from it
            p_resp, d_resp = transfer_id_generate(p, decode_server, prompt, MAX_TOKENS)
            if _served(d_resp):
                break
        elapsed = time.monotonic() - t0
        assert _served(d_resp), "push loads to the restarted P still fail"
        assert output_ids(d_resp) == expected
        assert elapsed < 8.0, f"{elapsed:.1f} s: D waited for its transfer deadline"
        wait_until(lambda: stats(p).held_blocks == 0, 15, "the restarted P to free its blocks")
