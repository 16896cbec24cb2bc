"""The example proxy in front of 2 prefill + 2 decode real vLLM servers (NIXL, params flow): outputs equal a
colocated run, every server serves, a killed D is evicted and used again once restarted, client disconnects
abort D and free P's blocks, bad input gets OpenAI-style errors."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvc_testing.cluster import (
    ENTRY_POINT_FORM,
    MODULE_FORM,
    ProxyProcess,
    make_prompts,
    metric,
    pd_server,
    stats,
    wait_until,
)
from kvc_testing.load import (
    CONCURRENCY,
    Case,
    Outcome,
    compare,
    expected,
    make_cases,
    proxy_health,
    proxy_metric,
    run_all,
    run_case,
)
from kvc_testing.procs import VllmServer
from tests.e2e.conftest import MAX_MODEL_LEN

D_CONFIG = {"handshake_timeout_s": 5, "transfer_timeout_s": 10}


class XPyD:
    """2 P + 2 D behind the proxy: P1/D1 are the session's servers, P2/D2 this module's (D2 gets killed),
    and the session's colocated reference."""

    def __init__(self, tiny_model: Any) -> None:
        self.tiny_model = tiny_model
        self.p2 = pd_server(tiny_model, "kv_producer", form=MODULE_FORM, name="P2", max_model_len=MAX_MODEL_LEN)
        self.d2 = self.new_d2()
        self.p1: VllmServer | None = None
        self.d1: VllmServer | None = None
        self.reference: VllmServer | None = None
        self.proxy: ProxyProcess | None = None

    @property
    def prefill(self) -> list[VllmServer]:
        return [self.p1, self.p2]  # type: ignore[list-item]

    @property
    def decode(self) -> list[VllmServer]:
        return [self.d1, self.d2]  # type: ignore[list-item]

    def new_d2(self, port: int | None = None, side_channel_port: int | None = None) -> VllmServer:
        return pd_server(
            self.tiny_model,
            "kv_consumer",
            form=ENTRY_POINT_FORM,
            name="D2",
            max_model_len=MAX_MODEL_LEN,
            extra_config=D_CONFIG,
            port=port,
            side_channel_port=side_channel_port,
        )

    def start_proxy(self) -> None:
        for server in (self.p2, self.d2):
            server.wait_ready()
        self.proxy = ProxyProcess(
            [p.url for p in self.prefill],
            [d.url for d in self.decode],
            extra_args=["--health-interval-s", "0.5", "--health-timeout-s", "2", "--decode-timeout-s", "60"],
        )
        self.proxy.start()
        self.proxy.wait_ready()

    def stop(self) -> None:
        for proc in (self.proxy, self.d2, self.p2):
            if proc is not None:
                proc.stop()


@pytest.fixture(scope="module")
def xpyd(tiny_model, request) -> Iterator[XPyD]:
    """Module scope: P2, D2 and the proxy go away when this file is done (memory on small hosts).
    P2 and D2 boot while the session's servers start (the tests do not ask for those directly, since pytest
    would start session fixtures first)."""
    cluster = XPyD(tiny_model)
    try:
        cluster.p2.start()
        cluster.d2.start()
        cluster.p1 = request.getfixturevalue("prefill_server")
        cluster.d1 = request.getfixturevalue("decode_server")
        cluster.reference = request.getfixturevalue("reference")
        cluster.start_proxy()
        yield cluster
    finally:
        cluster.stop()


def test_100_requests_equal_colocated_and_every_server_serves(xpyd: XPyD) -> None:
    cases = make_cases(100, seed=21)
    want = expected(xpyd.reference, cases)
    assert len({repr(w.output) for w in want}) > 50, "tiny model output is near-constant"
    p0, d0 = [stats(p) for p in xpyd.prefill], [stats(d) for d in xpyd.decode]
    ok0 = proxy_metric(xpyd.proxy, "kvc_proxy_requests_total", outcome="ok")
    seeded0 = proxy_metric(xpyd.proxy, "kvc_proxy_first_token_total", result="seeded")
    unseedable0 = proxy_metric(xpyd.proxy, "kvc_proxy_first_token_total", result="answer_not_seedable")
    got = run_all(xpyd.proxy.url, cases)
    bad = compare(cases, got, want)
    assert not bad, f"{len(bad)} of {len(cases)} differ: " + "; ".join(bad[:5])
    assert proxy_metric(xpyd.proxy, "kvc_proxy_requests_total", outcome="ok") - ok0 == len(cases)
    # Half the cases are streamed: the first token came from P wherever P's token was whole text.
    seeded = proxy_metric(xpyd.proxy, "kvc_proxy_first_token_total", result="seeded") - seeded0
    unseedable = proxy_metric(xpyd.proxy, "kvc_proxy_first_token_total", result="answer_not_seedable") - unseedable0
    assert seeded + unseedable == sum(c.stream for c in cases) and seeded >= 10, (seeded, unseedable)

    sends = [stats(p).completed_sends - s.completed_sends for p, s in zip(xpyd.prefill, p0)]
    loads = [stats(d).recv_transfers - s.recv_transfers for d, s in zip(xpyd.decode, d0)]
    assert all(n >= 20 for n in sends), f"P completed sends {sends}"
    assert all(n >= 20 for n in loads), f"D loads {loads}"
    assert all(stats(d).recv_failures == s.recv_failures for d, s in zip(xpyd.decode, d0))
    health = proxy_health(xpyd.proxy)
    assert [b["served"] > 0 for b in health["prefill"] + health["decode"]] == [True] * 4
    print(
        f"\n100 requests: first token from P for {seeded:g} of {sum(c.stream for c in cases)} streamed "
        f"({unseedable:g} not seedable), P completed sends {sends}, D loads {loads}, "
        f"proxy served P {[b['served'] for b in health['prefill']]} D {[b['served'] for b in health['decode']]}"
    )
    # 40 s: longer than a lease (30 s) an earlier test file may have left on the shared P
    wait_until(lambda: all(stats(p).held_blocks == 0 for p in xpyd.prefill), 40, "both P to free every block")


LOAD_REQUESTS = 300
LOAD_CONCURRENCY = 24


def _log_count(server: VllmServer, text: str) -> int:
    return server.log_path.read_text(errors="replace").count(text)


def test_load_300_requests_at_concurrency_24_no_wrong_answer(xpyd: XPyD) -> None:
    """Servers sharing 2 cores under load (D's queue grows, handshakes and claims compete with the
    forward passes): no request answered with wrong tokens, none lost, few errors, none to a live peer
    timing out, and P holds no block at the end."""
    cases = make_cases(LOAD_REQUESTS, seed=55)
    want = expected(xpyd.reference, cases)
    no_answer0 = [_log_count(d, "no answer from side channel") for d in xpyd.decode]
    latencies: list[float] = []
    lock = threading.Lock()

    def timed(case: Case) -> Outcome:
        t0 = time.monotonic()
        outcome = run_case(xpyd.proxy.url, case, timeout=300)
        with lock:
            latencies.append(time.monotonic() - t0)
        return outcome

    t0 = time.monotonic()
    with ThreadPoolExecutor(LOAD_CONCURRENCY) as pool:
        got = list(pool.map(timed, cases))
    wall = time.monotonic() - t0
    errors = [g.error for g in got if not g.ok]
    wrong = [b for b in compare(cases, got, want) if ": error " not in b]
    latencies.sort()
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99) - 1]
    d_stats = [stats(d) for d in xpyd.decode]
    print(
        f"\nload: {LOAD_REQUESTS} requests at concurrency {LOAD_CONCURRENCY} in {wall:.0f} s: "
        f"{len(wrong)} wrong, {len(errors)} errors, p50 {p50:.2f} s, p99 {p99:.2f} s; "
        f"stale reads refused {[s.stale_reads_refused for s in d_stats]}, "
        f"lease renewals {[s.lease_renewals for s in d_stats]}; errors {errors[:5]}"
    )
    assert not wrong, f"{len(wrong)} answered with tokens other than colocated: {wrong[:3]}"
    assert len(errors) <= LOAD_REQUESTS * 0.01, errors[:10]  # a load failure before the first token is retried
    no_answer = [_log_count(d, "no answer from side channel") - n for d, n in zip(xpyd.decode, no_answer0)]
    assert no_answer == [0, 0], f"handshakes or claims to live producers went unanswered: {no_answer}"
    wait_until(lambda: all(stats(p).held_blocks == 0 for p in xpyd.prefill), 40, "both P to free every block")


def test_client_disconnect_mid_stream_aborts_d_and_frees_p(xpyd: XPyD) -> None:
    prompt = make_prompts([40], seed=5)[0]
    max_tokens = MAX_MODEL_LEN - 40 - 2
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    gen0 = sum(metric(d.url, "vllm:generation_tokens_total") for d in xpyd.decode)
    gone0 = proxy_metric(xpyd.proxy, "kvc_proxy_requests_total", outcome="client_disconnected")
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{xpyd.proxy.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_bytes()
            for _ in range(3):
                next(chunks)
        # leaving the block closes the connection mid-stream
    wait_until(lambda: all(metric(d.url, "vllm:num_requests_running") == 0 for d in xpyd.decode), 15, "D to abort the request")
    generated = sum(metric(d.url, "vllm:generation_tokens_total") for d in xpyd.decode) - gen0
    assert generated < max_tokens, f"D generated {generated} of {max_tokens} tokens: not aborted"
    wait_until(lambda: all(stats(p).held_blocks == 0 for p in xpyd.prefill), 15, "both P to free the blocks")
    wait_until(
        lambda: proxy_metric(xpyd.proxy, "kvc_proxy_requests_total", outcome="client_disconnected") == gone0 + 1,
        10,
        "the proxy to count the disconnect",
    )
    assert all(b["outstanding"] == 0 for b in proxy_health(xpyd.proxy)["decode"])


@pytest.mark.parametrize(
    "path, kwargs, status, words",
    [
        ("/v1/completions", {"content": b"{oops"}, 400, "invalid JSON"),
        ("/v1/completions", {"json": [1, 2]}, 400, "JSON object"),
        ("/v1/completions", {"json": {"max_tokens": 4}}, 400, "'prompt'"),
        ("/v1/chat/completions", {"json": {"messages": "hello"}}, 400, "'messages'"),
        ("/v1/completions", {"json": {"prompt": "a", "max_tokens": -3}}, 400, "'max_tokens'"),
        ("/v1/completions", {"json": {"prompt": "a", "stream": "no"}}, 400, "'stream'"),
        ("/v1/completions", {"json": {"prompt": "a", "n": 3}}, 400, "'n' > 1"),
        ("/v1/completions", {"json": {"prompt": "x" * (9 << 20)}}, 413, "exceeds"),
        (
            "/v1/completions",
            {"json": {"prompt": make_prompts([MAX_MODEL_LEN + 50])[0], "max_tokens": 4}},
            400,
            "maximum context length",
        ),
        (
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": "word " * 900}], "stream": True}},
            400,
            "context length",
        ),
    ],
)
def test_bad_input_gets_openai_errors_and_proxy_keeps_serving(xpyd: XPyD, path: str, kwargs: dict, status: int, words: str) -> None:
    resp = httpx.post(xpyd.proxy.url + path, timeout=60, **kwargs)
    assert resp.status_code == status, resp.text[:300]
    error = resp.json()["error"]
    assert words in error["message"] and error["type"], error
    assert run_case(xpyd.proxy.url, Case("cmpl_ids", [5, 6, 7, 8], stream=False)).ok


def test_a_frozen_p_costs_its_prompts_the_hedge_delay(xpyd: XPyD) -> None:
    """P2 frozen (SIGSTOP) and not evicted (health checks a minute apart, P's deadline a minute): each
    prompt the round robin sends to P2 is hedged on P1 after 0.5 s and answered exactly, in seconds rather
    than P's deadline; once P2 resumes, the requests the proxy cancelled on it leave no block held."""
    cases = make_cases(6, seed=61)  # one at a time: half of them go to P2 first
    want = expected(xpyd.reference, cases)
    p2 = xpyd.p2
    args = ["--health-interval-s", "60", "--prefill-timeout-s", "60", "--hedge-prefill", "0.5"]
    with ProxyProcess([p.url for p in xpyd.prefill], [d.url for d in xpyd.decode], extra_args=args) as proxy:
        proxy.wait_ready()
        os.killpg(p2.pgid, signal.SIGSTOP)
        try:
            got = [run_case(proxy.url, case, timeout=120) for case in cases]
        finally:
            os.killpg(p2.pgid, signal.SIGCONT)
        won = proxy_metric(proxy, "kvc_proxy_prefill_hedges_total", result="won")
        retries = proxy_metric(proxy, "kvc_proxy_retries_total", role="prefill")
    seconds = [round(g.seconds, 2) for g in got]
    print(f"\nP2 frozen: {len(cases)} prompts one at a time in {seconds} s; hedges won {won:g}, prefill retries {retries:g}")
    bad = compare(cases, got, want)
    assert not bad, bad
    assert won == len(cases) // 2 and retries == 0, (won, retries)  # every prompt sent to P2 first, none retried
    assert max(seconds) < 20, seconds  # without the hedge: P's 60 s deadline, then a retry
    wait_until(lambda: stats(p2).held_blocks == 0, 40, "the resumed P2 to free every block")


def test_killed_decode_is_evicted_then_used_again_after_restart(xpyd: XPyD) -> None:
    reference = xpyd.reference
    cases = make_cases(48, seed=33, max_tokens=96)  # long enough to be in flight on D2 when it dies
    want = expected(reference, cases)
    before = {
        name: proxy_metric(xpyd.proxy, "kvc_proxy_requests_total", outcome=name)
        for name in ("ok", "upstream_error", "upstream_timeout", "failed_mid_stream", "no_backend")
    }
    retries0 = proxy_metric(xpyd.proxy, "kvc_proxy_retries_total", role="decode")
    internal0 = proxy_metric(xpyd.proxy, "kvc_proxy_requests_total", outcome="internal_error")
    done = [0]
    lock = threading.Lock()
    kill_now = threading.Event()

    def on_done() -> None:
        with lock:
            done[0] += 1
            if done[0] == 10:
                kill_now.set()

    d2 = xpyd.d2

    def kill_when_busy() -> None:
        # Killed while it holds requests: with only one on it (or none) the kill may meet no request at all.
        if not kill_now.wait(120):
            return
        deadline = time.monotonic() + 10
        while proxy_health(xpyd.proxy)["decode"][1]["outstanding"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(d2.pgid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    got = run_all(xpyd.proxy.url, cases, on_done)
    killer.join()
    d2.stop()
    assert not d2.group_alive()

    # No request lost: each one equals the colocated output or carries a clear error, and the proxy counted both.
    errors = [g for g in got if not g.ok]
    # A dead D is an upstream failure (retried, or a 502 / SSE error naming it), never the proxy's own error.
    assert not [e for e in errors if e.error.startswith("500")], errors
    assert proxy_metric(xpyd.proxy, "kvc_proxy_requests_total", outcome="internal_error") == internal0
    bad = [b for b in compare(cases, got, want) if ": error " not in b]
    assert not bad, bad
    after = {name: proxy_metric(xpyd.proxy, "kvc_proxy_requests_total", outcome=name) for name in before}
    assert after["ok"] - before["ok"] == len(cases) - len(errors)
    assert sum(after[n] - before[n] for n in before if n != "ok") == len(errors), (errors, after, before)
    assert len(errors) <= CONCURRENCY, errors  # only requests already streaming from D2 may fail
    retries = proxy_metric(xpyd.proxy, "kvc_proxy_retries_total", role="decode") - retries0
    print(
        f"\nD2 killed after 10 of {len(cases)} requests: {len(cases) - len(errors)} ok, {len(errors)} clear errors "
        f"{[e.error[:80] for e in errors]}, decode retries {retries:g}, outcomes "
        f"{ {n: after[n] - before[n] for n in before} }"
    )
    # The kill met requests on D2: those before their first byte were retried, the others failed clearly.
    assert retries + after["failed_mid_stream"] - before["failed_mid_stream"] >= 1

    # The dead D is out of rotation and new requests succeed on the other one.
    wait_until(lambda: not proxy_health(xpyd.proxy)["decode"][1]["healthy"], 10, "the proxy to evict D2")
    assert proxy_metric(xpyd.proxy, "kvc_proxy_evictions_total", role="decode") >= 1
    fresh = make_cases(6, seed=44)
    assert not compare(fresh, run_all(xpyd.proxy.url, fresh), expected(reference, fresh))

    # Restarted on the same ports, it is put back and serves again.
    xpyd.d2 = xpyd.new_d2(port=d2.port, side_channel_port=d2.side_channel_port)  # type: ignore[attr-defined]
    xpyd.d2.start()
    xpyd.d2.wait_ready()
    wait_until(lambda: proxy_health(xpyd.proxy)["decode"][1]["healthy"], 15, "the proxy to restore D2")
    served0 = proxy_health(xpyd.proxy)["decode"][1]["served"]
    loads0 = stats(xpyd.d2).recv_transfers
    again = make_cases(8, seed=55)
    assert not compare(again, run_all(xpyd.proxy.url, again), expected(reference, again))
    assert proxy_health(xpyd.proxy)["decode"][1]["served"] - served0 >= 2
    assert stats(xpyd.d2).recv_transfers - loads0 >= 1
