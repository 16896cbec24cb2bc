"""The proxy's routing decisions on real vLLM servers: a KV load that fails before D's first token is retried
(the client gets the exact answer, never an error event), a prefill server drained under load finishes its
requests and gets no new ones, and with every prefill server dead D computes prompts itself, exactly."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvc_testing.cluster import MODULE_FORM, ProxyProcess, make_prompts, pd_server, stats
from kvc_testing.load import compare, expected, make_cases, proxy_health, proxy_metric, run_all, run_case
from kvc_testing.procs import VllmServer
from tests.e2e.conftest import MAX_MODEL_LEN

TOKEN = "e2e-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROXY_ARGS = ["--health-interval-s", "0.5", "--health-timeout-s", "5", "--unhealthy-after", "3", "--decode-timeout-s", "60"]


@dataclass
class Fleet:
    p: VllmServer  # the session's P
    d: VllmServer  # the session's D (handshake deadline 5 s)
    reference: VllmServer
    unreachable: VllmServer  # a P that answers prefills but advertises a side channel nobody can reach
    victim: VllmServer  # a P that gets drained, then killed

    def proxy(self, prefill: list[VllmServer], **kwargs: Any) -> ProxyProcess:
        return ProxyProcess(
            [p.url for p in prefill],
            [self.d.url],
            extra_args=PROXY_ARGS,
            env={**os.environ, "KVC_PROXY_ADMIN_TOKEN": TOKEN},
            **kwargs,
        )


@pytest.fixture(scope="module")
def fleet(tiny_model, request) -> Iterator[Fleet]:
    # D reaches this P's KV at 127.0.0.2, where nothing listens: its handshake fails at D's deadline, like a
    # P that died right after answering the prefill.
    unreachable = pd_server(
        tiny_model,
        "kv_producer",
        form=MODULE_FORM,
        name="P-unreachable",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"side_channel_host": "127.0.0.2", "side_channel_bind_host": "127.0.0.1"},
    )
    victim = pd_server(tiny_model, "kv_producer", form=MODULE_FORM, name="P-victim", max_model_len=MAX_MODEL_LEN)
    try:
        unreachable.start()
        victim.start()
        cluster = Fleet(
            request.getfixturevalue("prefill_server"),
            request.getfixturevalue("decode_server"),
            request.getfixturevalue("reference"),
            unreachable,
            victim,
        )
        unreachable.wait_ready()
        victim.wait_ready()
        yield cluster
    finally:
        victim.stop()
        unreachable.stop()


def test_load_failing_before_the_first_token_is_retried_with_the_exact_answer(fleet: Fleet) -> None:
    cases = make_cases(12, seed=71)  # completions ids and text, chat; streamed and not
    want = expected(fleet.reference, cases)
    failures0 = stats(fleet.d).recv_failures
    with fleet.proxy([fleet.unreachable, fleet.p]) as proxy:
        proxy.wait_ready()
        got = run_all(proxy.url, cases)
        retries = proxy_metric(proxy, "kvc_proxy_retries_total", role="decode")
        ok = proxy_metric(proxy, "kvc_proxy_requests_total", outcome="ok")
        served = [b["served"] for b in proxy_health(proxy)["prefill"]]
        fallbacks = proxy_metric(proxy, "kvc_proxy_decode_only_total", mode="fallback")
    failed_loads = stats(fleet.d).recv_failures - failures0
    print(
        f"\n{len(cases)} requests, P-unreachable first for some: D load failures {failed_loads}, proxy retries "
        f"{retries:g}, D alone after the first token {fallbacks:g}, P served {served}"
    )
    bad = compare(cases, got, want)
    assert not bad, f"{len(bad)} of {len(cases)}: " + "; ".join(bad[:4])  # no error event reached a client
    assert ok == len(cases)
    assert failed_loads >= 3 and retries == failed_loads, (failed_loads, retries)  # each failed load: one retry
    # P-unreachable answered; each failed load was retried with a fresh prefill on P or, where the client
    # already had the first token from P-unreachable, continued on D alone
    assert served[0] >= 3 and served[1] + fallbacks == len(cases), (served, fallbacks)


def _drain(proxy: ProxyProcess, url: str, timeout_s: float = 90) -> dict[str, Any]:
    resp = httpx.post(
        f"{proxy.url}/admin/drain",
        json={"role": "prefill", "url": url, "timeout_s": timeout_s},
        headers=AUTH,
        timeout=timeout_s + 10,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_drain_a_prefill_under_load_then_bring_it_back(fleet: Fleet) -> None:
    cases = make_cases(36, seed=72)
    want = expected(fleet.reference, cases)
    with fleet.proxy([fleet.p, fleet.victim]) as proxy:
        proxy.wait_ready()
        refused = httpx.post(f"{proxy.url}/admin/drain", json={"role": "prefill", "url": fleet.victim.url}, timeout=10)
        wrong = httpx.post(
            f"{proxy.url}/admin/drain",
            json={"role": "prefill", "url": fleet.victim.url},
            headers={"Authorization": "Bearer x"},
            timeout=10,
        )
        assert (refused.status_code, wrong.status_code) == (401, 403)
        assert not proxy_health(proxy)["prefill"][1]["draining"]

        done = [0]
        lock = threading.Lock()
        report: dict[str, Any] = {}
        served_after: list[int] = []
        drain_now = threading.Event()

        def on_done() -> None:
            with lock:
                done[0] += 1
                if done[0] == 8:
                    drain_now.set()

        def drainer() -> None:
            if drain_now.wait(120):
                report.update(_drain(proxy, fleet.victim.url))
                served_after.append(proxy_health(proxy)["prefill"][1]["served"])

        thread = threading.Thread(target=drainer)
        thread.start()
        got = run_all(proxy.url, cases, on_done)
        thread.join()
        health = proxy_health(proxy)
        victim_after_load = health["prefill"][1]
        print(f"\ndrain under load: report {report}; served P {[b['served'] for b in health['prefill']]}")
        bad = compare(cases, got, want)
        assert not bad, bad[:4]  # no request failed
        assert report["drained"] is True and report["outstanding"] == 0 and report["draining"] is True
        assert victim_after_load["served"] == served_after[0] >= 1  # nothing new once drained
        assert victim_after_load["draining"] is True and health["status"] == "ok"
        assert proxy_metric(proxy, "kvc_proxy_requests_total", outcome="ok") == len(cases)

        undrain = httpx.post(
            f"{proxy.url}/admin/undrain", json={"role": "prefill", "url": fleet.victim.url}, headers=AUTH, timeout=10
        )
        assert undrain.status_code == 200
        again = make_cases(6, seed=73)
        assert not compare(again, run_all(proxy.url, again), expected(fleet.reference, again))
        assert proxy_health(proxy)["prefill"][1]["served"] > victim_after_load["served"]  # serves again

        # removed, then added back: the same
        assert httpx.request(
            "DELETE", f"{proxy.url}/admin/backends", json={"role": "prefill", "url": fleet.victim.url}, headers=AUTH, timeout=10
        ).json()["removed"]
        assert [b["url"] for b in proxy_health(proxy)["prefill"]] == [fleet.p.url]
        added = httpx.post(
            f"{proxy.url}/admin/backends", json={"role": "prefill", "url": fleet.victim.url}, headers=AUTH, timeout=10
        )
        assert added.status_code == 201
        sends0 = stats(fleet.victim).completed_sends
        assert not compare(again, run_all(proxy.url, again), expected(fleet.reference, again))
        assert stats(fleet.victim).completed_sends > sends0


def test_every_prefill_dead_decode_computes_prompts_exactly(fleet: Fleet) -> None:
    cases = make_cases(9, seed=74)
    want = expected(fleet.reference, cases)
    with fleet.proxy([fleet.victim, fleet.unreachable]) as proxy:
        proxy.wait_ready()
        warm = make_cases(3, seed=75)
        assert not compare(warm, run_all(proxy.url, warm), expected(fleet.reference, warm))
        fallbacks0 = proxy_metric(proxy, "kvc_proxy_decode_only_total", mode="fallback")
        for server in (fleet.victim, fleet.unreachable):
            os.killpg(server.pgid, signal.SIGKILL)
            server.stop()
        got = run_all(proxy.url, cases)
        fallbacks = proxy_metric(proxy, "kvc_proxy_decode_only_total", mode="fallback") - fallbacks0
        health = proxy_health(proxy)
        bad = compare(cases, got, want)
        assert not bad, bad[:4]
        assert fallbacks == len(cases), fallbacks
        assert health["status"] == "ok"
        deadline = time.monotonic() + 15
        while any(b["healthy"] for b in proxy_health(proxy)["prefill"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(b["healthy"] for b in proxy_health(proxy)["prefill"])
        assert run_case(proxy.url, cases[0]).ok


def _stream_logprobs(url: str, path: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """A streamed answer's text and its logprob entries in order (completions: one per token with its text
    offset; chat: the content entries)."""
    text, entries = "", []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()[:300]
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                lp = choice.get("logprobs")
                if path.endswith("chat/completions"):
                    text += (choice.get("delta") or {}).get("content") or ""
                    entries += (lp or {}).get("content") or []
                else:
                    text += choice.get("text") or ""
                    if lp:
                        entries += [
                            (t, round(v, 3), o, {k: round(x, 3) for k, x in (top or {}).items()})
                            for t, v, o, top in zip(lp["tokens"], lp["token_logprobs"], lp["text_offset"], lp["top_logprobs"])
                        ]
    return text, entries


def _rounded_chat(entries: list[Any]) -> list[Any]:
    return [
        (e["token"], round(e["logprob"], 3), [(t["token"], round(t["logprob"], 3)) for t in e["top_logprobs"]]) for e in entries
    ]


def test_seeded_logprobs_equal_colocated(fleet: Fleet) -> None:
    """First token from prefill with logprobs asked: P's for the first token, D's after it (completions'
    text offsets moved past the first token), as one colocated server streams them."""
    prompts = make_prompts([40, 90, 150, 260], seed=76)
    with fleet.proxy([fleet.p]) as proxy:
        proxy.wait_ready()
        seeded0 = proxy_metric(proxy, "kvc_proxy_first_token_total", result="seeded")
        for i, prompt in enumerate(prompts):
            cmpl = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2}
            assert _stream_logprobs(proxy.url, "/v1/completions", cmpl) == _stream_logprobs(
                fleet.reference.url, "/v1/completions", cmpl
            )
            words = " ".join(["garden", "river", "stone", "light"][j % 4] for j in range(10 + 15 * i))
            chat = {
                "messages": [{"role": "user", "content": words}],
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            }
            got_text, got = _stream_logprobs(proxy.url, "/v1/chat/completions", chat)
            want_text, want = _stream_logprobs(fleet.reference.url, "/v1/chat/completions", chat)
            assert (got_text, _rounded_chat(got)) == (want_text, _rounded_chat(want))
        seeded = proxy_metric(proxy, "kvc_proxy_first_token_total", result="seeded") - seeded0
    assert seeded >= 4, seeded  # most of the 8 streams had their first token from P
