"""1P1D over our NIXL connector with real vLLM servers: greedy-exact against colocated, KV really moved."""

from __future__ import annotations

import json

import httpx
import pytest

from kvc_testing.cluster import generate, make_prompts, metric, output_ids, stats, wait_until
from tests.e2e.checks import MAX_TOKENS, PROMPTS, assert_foreign_kv_changes_output, assert_pd_matches_colocated


def _p_released(prefill_server) -> bool:
    return stats(prefill_server).held_blocks == 0


def test_pd_greedy_equals_colocated_through_proxy(reference, prefill_server, decode_server, proxy):
    assert_pd_matches_colocated(reference, prefill_server, decode_server, proxy)


def test_chat_and_streaming_through_proxy(reference, proxy):
    chat = {
        "messages": [{"role": "user", "content": "tell me about the garden and the paper"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    ref = httpx.post(f"{reference.url}/v1/chat/completions", json=chat, timeout=60).json()
    got = httpx.post(f"{proxy.url}/v1/chat/completions", json=chat, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]

    prompt = PROMPTS[15]
    ref_text = generate(reference.url, prompt, MAX_TOKENS).json()["choices"][0]["text"]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text = ""
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == ref_text


def test_prefix_cache_hit_on_decode_reads_only_the_rest(reference, prefill_server, decode_server, proxy):
    base = make_prompts([200], seed=7)[0]
    first, second = base + [5, 6, 7], base + [8, 9, 10, 11]  # share 6 full blocks
    assert output_ids(generate(proxy.url, first, MAX_TOKENS)) == output_ids(generate(reference.url, first, MAX_TOKENS))
    d0 = stats(decode_server)
    assert output_ids(generate(proxy.url, second, MAX_TOKENS)) == output_ids(generate(reference.url, second, MAX_TOKENS))
    d1 = stats(decode_server)
    assert d1.recv_transfers - d0.recv_transfers == 1
    assert d1.recv_blocks - d0.recv_blocks == 1, "D re-read blocks it had in its prefix cache"
    wait_until(lambda: _p_released(prefill_server), 10, "P to free the blocks")


def test_foreign_kv_changes_decode_output(reference, perturbed_prefill, decode_server):
    assert_foreign_kv_changes_output(reference, perturbed_prefill, decode_server)


def test_phase_histograms_move_and_add_up(prefill_server, decode_server, proxy):
    """Per-phase histograms on real servers: each moves once per PD request, and the phases fit
    inside the load (handshake + transfer = total; the read and the claim lie within the transfer)."""

    d, p = decode_server.url, prefill_server.url
    names = ("load_queue", "load_handshake", "load_claim", "load_read", "load_total", "transfer")

    def sums() -> dict[str, tuple[float, float]]:
        return {n: (metric(d, f"kvc:{n}_seconds_count"), metric(d, f"kvc:{n}_seconds_sum")) for n in names}

    before, holds0 = sums(), metric(p, "kvc:lease_hold_seconds_count")
    prompts = make_prompts([48, 200, 420], seed=11)
    for prompt in prompts:
        assert generate(proxy.url, prompt, 4).status_code == 200
    wait_until(lambda: metric(d, "kvc:load_total_seconds_count") - before["load_total"][0] >= len(prompts), 10, "D's phases")
    wait_until(lambda: metric(p, "kvc:lease_hold_seconds_count") - holds0 >= len(prompts), 10, "P's lease holds")
    after = sums()
    count = {n: after[n][0] - before[n][0] for n in names}
    total = {n: after[n][1] - before[n][1] for n in names}
    assert all(c == len(prompts) for c in count.values()), count
    assert total["load_handshake"] + total["transfer"] == pytest.approx(total["load_total"], rel=1e-6, abs=1e-6)
    assert total["load_read"] <= total["transfer"] + 1e-6 and total["load_claim"] <= total["transfer"] + 1e-6
    assert all(v >= 0 for v in total.values()) and total["transfer"] > 0


def test_reads_are_proved_by_lease_words_without_a_claim(reference, prefill_server, decode_server, proxy):
    """Real NIXL (cma here): D reads P's lease words after each read; they prove the lease live, so
    P answers no claim, and the answers are still exact."""
    words0, granted0 = stats(decode_server).reads_fenced_by_words, stats(prefill_server).claims_granted
    prompts = make_prompts([64, 300], seed=12)  # not seen before: D loads each one
    assert_pd_matches_colocated(reference, prefill_server, decode_server, proxy, prompts)
    wait_until(lambda: stats(decode_server).reads_fenced_by_words - words0 >= len(prompts), 10, "D's reads fenced by words")
    assert stats(prefill_server).claims_granted == granted0, "P answered claims although the words proved the reads"


def test_dashboard_metrics_are_exported(prefill_server, decode_server, proxy):
    """Every sample the example Grafana dashboard queries is on P's, D's or the proxy's /metrics."""
    from kvc_testing import dashboard

    assert generate(proxy.url, PROMPTS[3], 4).status_code == 200  # the proxy's labelled series exist once used
    pages = [httpx.get(f"{u}/metrics", timeout=10).text for u in (prefill_server.url, decode_server.url, proxy.url)]
    exported = set().union(*(dashboard.exported(page) for page in pages))
    missing = dashboard.sample_names(dashboard.load()) - exported
    assert not missing, f"the dashboard queries metrics no server exports: {sorted(missing)}"
