"""The transfer-id flow (P and D sent at once, as with Mooncake-style proxies) and layer-wise push,
with real vLLM servers over NIXL."""

from __future__ import annotations

import time

from kv_connectors.testing.cluster import generate, output_ids, stats, wait_until
from tests.e2e.checks import MAX_TOKENS, PROMPTS, assert_transfer_id_flow_matches, transfer_id_generate


def test_transfer_id_flow_greedy_equals_colocated(reference, prefill_server, decode_server):
    """D is a pull-mode consumer: for a transfer-id request it still asks P to push (P's blocks are unknown)."""
    layerwise = assert_transfer_id_flow_matches(reference, prefill_server, decode_server, PROMPTS)
    print(f"layer-wise pushes when sent at once: {layerwise}/{len(PROMPTS)}")


def test_layerwise_push_when_decode_asks_first(reference, prefill_server, decode_server):
    """D's push request is at P before P computes: every layer is written as soon as it is computed."""
    assert_transfer_id_flow_matches(reference, prefill_server, decode_server, PROMPTS[-6:], d_first_s=1.0)


def test_decode_whose_prefill_never_comes_fails_within_deadline(reference, prefill_server, decode_server):
    """D waits for a P that never gets the request: it fails that request by its deadline (10 s here),
    P drops the push request, and both keep serving."""
    d0 = stats(decode_server)
    prompt = PROMPTS[12]
    t0 = time.monotonic()
    d_params = {"do_remote_prefill": True, "transfer_id": "kvc-never-prefilled",
                "remote_host": "127.0.0.1", "remote_port": prefill_server.side_channel_port}
    r = generate(decode_server.url, prompt, MAX_TOKENS, kv_transfer_params=d_params, timeout=60)
    assert time.monotonic() - t0 < 25
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:300]
    assert stats(decode_server).recv_failures == d0.recv_failures + 1
    p_resp, d_resp = transfer_id_generate(prefill_server, decode_server, prompt, MAX_TOKENS)
    assert p_resp.status_code == 200
    assert output_ids(d_resp) == output_ids(generate(reference.url, prompt, MAX_TOKENS))
    wait_until(lambda: stats(prefill_server).held_blocks == 0, 10, "P to free the blocks")
