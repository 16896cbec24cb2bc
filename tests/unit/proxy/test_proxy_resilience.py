"""Proxy retries, passive and active health, mid-stream failures and client disconnects, against fake backends."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.unit.proxy.proxy_fakes import (
    D1,
    D2,
    P1,
    P2,
    ChunkStream,
    Fleet,
    asgi_stream,
    config,
    metric_value,
    running,
    sse,
    text_chunks,
)

pytestmark = pytest.mark.anyio


async def _metrics(client: httpx.AsyncClient) -> str:
    return (await client.get("/metrics")).text


async def _health(client: httpx.AsyncClient) -> dict:
    return (await client.get("/health")).json()


async def test_prefill_unreachable_retried_on_other_p_and_evicted() -> None:
    fleet = Fleet((P1, P2), (D1,))
    fleet[P1].error = httpx.ConnectError("connection refused")
    async with running(config((P1, P2)), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1]})
        assert resp.status_code == 200, resp.text
        assert fleet.urls() == [P1, P2, D1]
        health = await _health(client)
        assert [b["healthy"] for b in health["prefill"]] == [False, True] and health["status"] == "ok"
        assert health["prefill"][0]["failures"] == 1
        # P1 is out of rotation: the next requests all go to P2
        for _ in range(2):
            assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
        assert [u for u in fleet.urls() if u.startswith("http://p")] == [P1, P2, P2, P2]
        text = await _metrics(client)
    assert metric_value(text, "kvc_proxy_retries_total", role="prefill") == 1
    assert metric_value(text, "kvc_proxy_evictions_total", role="prefill") == 1
    assert metric_value(text, "kvc_proxy_backend_healthy", role="prefill", url=P1) == 0


async def test_prefill_5xx_retried_without_eviction() -> None:
    fleet = Fleet((P1, P2), (D1,))
    fleet[P1].status = 500
    async with running(config((P1, P2)), fleet) as (_, client):
        assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
        assert fleet.urls() == [P1, P2, D1]
        assert [b["healthy"] for b in (await _health(client))["prefill"]] == [True, True]


async def test_prefill_timeout_retried() -> None:
    fleet = Fleet((P1, P2), (D1,))
    fleet[P1].hold = True
    async with running(config((P1, P2), prefill_timeout_s=0.2), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1]})
    assert resp.status_code == 200 and fleet.urls() == [P1, P2, D1]


async def _started(server, n: int = 1) -> None:
    for _ in range(500):
        if server.started >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{server.url} never got request {n}")


async def test_a_prefill_on_a_p_evicted_meanwhile_goes_to_another_p_at_once() -> None:
    """A frozen P (SIGSTOP) keeps its connections open and never answers: once the health checks
    evict it, a prefill in flight on it is sent to another P instead of waiting out its timeout."""
    fleet = Fleet((P1, P2), (D1,))
    fleet[P1].hold = True
    async with running(config((P1, P2), unhealthy_after=1), fleet) as (app, client):
        request = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": [1]}))
        await _started(fleet[P1])
        fleet[P1].health = False
        await app.state.health_checker.check_once()
        resp = await asyncio.wait_for(request, 5)
        text = await _metrics(client)
    assert resp.status_code == 200, resp.text
    assert fleet.urls() == [P1, P2, D1] and fleet[P1].cancelled == 1
    assert metric_value(text, "kvc_proxy_retries_total", role="prefill") == 1


async def test_a_prefill_on_an_evicted_p_waits_when_nothing_else_could_take_it() -> None:
    """No other P and no decode-only fallback: the prefill waits for the evicted P (it may resume)."""
    fleet = Fleet((P1,), (D1,))
    fleet[P1].delay_s = 0.3
    cfg = config((P1,), unhealthy_after=1, decode_only_fallback=False)
    async with running(cfg, fleet) as (app, client):
        request = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": [1]}))
        await _started(fleet[P1])
        fleet[P1].health = False
        await app.state.health_checker.check_once()
        resp = await asyncio.wait_for(request, 5)
    assert resp.status_code == 200 and fleet.urls() == [P1, D1] and fleet[P1].cancelled == 0


@pytest.mark.parametrize("max_retries, calls", [(0, [P1]), (1, [P1, P2]), (5, [P1, P2])])
async def test_retries_are_bounded(max_retries: int, calls: list[str]) -> None:
    fleet = Fleet((P1, P2), (D1,))
    for p in (P1, P2):
        fleet[p].status = 502
    async with running(config((P1, P2), max_retries=max_retries, decode_only_fallback=False), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1]})
        text = await _metrics(client)
    assert resp.status_code == 502 and "prefill server" in resp.json()["error"]["message"]
    assert fleet.urls() == calls  # never D (no fallback), and never more than the P servers there are
    assert metric_value(text, "kvc_proxy_retries_total", role="prefill") == len(calls) - 1
    assert metric_value(text, "kvc_proxy_requests_total", route="/v1/completions", outcome="upstream_error") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_unreachable_retried_with_same_prefill(stream: bool) -> None:
    fleet = Fleet((P1,), (D1, D2))
    fleet[D1].error = httpx.ConnectError("connection refused")
    async with running(config(decode=(D1, D2)), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1], "stream": stream})
        assert resp.status_code == 200
        assert fleet.urls() == [P1, D1, D2]  # P's blocks still held: no second prefill
        d1, d2 = fleet.bodies(D1)[0], fleet.bodies(D2)[0]
        assert d1 == d2
        health = await _health(client)
        text = await _metrics(client)
    assert [b["healthy"] for b in health["decode"]] == [False, True]
    assert metric_value(text, "kvc_proxy_retries_total", role="decode") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_dropped_before_first_byte_prefills_again(stream: bool) -> None:
    fleet = Fleet((P1, P2), (D1, D2))
    if stream:
        fleet[D1].stream_factory = lambda: ChunkStream([], fail=httpx.RemoteProtocolError("peer closed"), fail_first=True)
    else:
        fleet[D1].error = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    async with running(config((P1, P2), (D1, D2)), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1], "stream": stream})
        assert resp.status_code == 200, resp.text
        if stream:
            assert resp.content == b"".join(text_chunks(["a", "b"]))
    # D1 may have read P1's blocks already: a fresh prefill on P2, then D2
    assert fleet.urls() == [P1, D1, P2, D2]


async def test_decode_timeout_is_504_not_retried() -> None:
    fleet = Fleet((P1,), (D1, D2))
    fleet[D1].hold = True
    async with running(config(decode=(D1, D2), decode_timeout_s=0.2), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1]})
    assert resp.status_code == 504 and "timed out" in resp.json()["error"]["message"]
    assert fleet.urls() == [P1, D1]


async def test_no_healthy_decode_is_503() -> None:
    fleet = Fleet()
    fleet[D1].error = httpx.ConnectError("refused")
    async with running(config(), fleet) as (_, client):
        first = await client.post("/v1/completions", json={"prompt": [1]})
        assert first.status_code == 502 and D1 in first.json()["error"]["message"]
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        second = await client.post("/v1/completions", json={"prompt": [1]})
        assert second.status_code == 503 and second.json()["error"]["message"] == "no healthy decode server"
    assert fleet.urls() == [P1, D1]  # no D left: the second request did not even prefill


async def test_decode_failure_mid_stream_ends_with_sse_error() -> None:
    fleet = Fleet()
    first = text_chunks(["a"])[0]
    fleet[D1].stream_factory = lambda: ChunkStream([first], fail=httpx.ReadError("connection reset"))
    async with running(config(), fleet) as (app, client):
        _, chunks = await asgi_stream(app, {"prompt": [1], "stream": True})
        text = await _metrics(client)
        health = await _health(client)
    assert chunks[0] == first and chunks[-1].endswith(b"data: [DONE]\n\n")
    error = json.loads(chunks[-1].split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and "mid-stream" in error["message"] and D1 in error["message"]
    assert metric_value(text, "kvc_proxy_requests_total", route="/v1/completions", outcome="failed_mid_stream") == 1
    assert health["decode"][0]["healthy"] is False and health["decode"][0]["failures"] == 1


async def test_active_checks_evict_and_restore() -> None:
    fleet = Fleet((P1,), (D1, D2))
    async with running(config(decode=(D1, D2), unhealthy_after=2), fleet) as (app, client):
        checker = app.state.health_checker
        fleet[D1].health = False
        await checker.check_once()
        assert [b["healthy"] for b in (await _health(client))["decode"]] == [True, True]  # one miss is not enough
        await checker.check_once()
        assert [b["healthy"] for b in (await _health(client))["decode"]] == [False, True]
        for _ in range(3):
            assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
        assert fleet.bodies(D1) == []
        fleet[D1].health = True
        await checker.check_once()
        assert [b["healthy"] for b in (await _health(client))["decode"]] == [True, True]
        fleet.calls.clear()
        for _ in range(2):
            await client.post("/v1/completions", json={"prompt": [1]})
        text = await _metrics(client)
    assert sorted(u for u in fleet.urls() if u.startswith("http://d")) == [D1, D2]
    assert metric_value(text, "kvc_proxy_evictions_total", role="decode") == 1
    assert metric_value(text, "kvc_proxy_backend_healthy", role="decode", url=D1) == 1


async def test_checker_runs_in_background() -> None:
    fleet = Fleet((P1,), (D1,))
    cfg = config(health_interval_s=0.02, health_timeout_s=0.5, unhealthy_after=2)
    async with running(cfg, fleet, health_checks=True) as (_, client):

        async def p_healthy_becomes(value: bool) -> None:
            for _ in range(200):
                if (await _health(client))["prefill"][0]["healthy"] is value:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"P never became healthy={value}")

        fleet[P1].health = False
        await p_healthy_becomes(False)
        health = await client.get("/health")
        assert health.status_code == 200  # D computes prompts itself (--decode-only-fallback)
        fleet[D1].health = False
        for _ in range(200):
            if (await client.get("/health")).status_code == 503:
                break
            await asyncio.sleep(0.01)
        assert (await client.get("/health")).status_code == 503
        fleet[P1].health = fleet[D1].health = True
        await p_healthy_becomes(True)
        for _ in range(200):
            if (await client.get("/health")).status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert (await client.get("/health")).status_code == 200
    assert fleet.health_calls >= 4


async def test_disconnect_while_prefilling_aborts_p() -> None:
    fleet = Fleet()
    fleet[P1].hold = True
    gone = asyncio.Event()
    fleet.on_request = lambda call: asyncio.get_running_loop().call_later(0.05, gone.set)
    async with running(config(), fleet) as (app, client):
        messages, _ = await asgi_stream(app, {"prompt": [1]}, disconnect=gone)
        text = await _metrics(client)
        health = await _health(client)
    assert fleet[P1].cancelled == 1 and fleet.bodies("decode") == []
    assert metric_value(text, "kvc_proxy_requests_total", route="/v1/completions", outcome="client_disconnected") == 1
    assert health["prefill"][0]["outstanding"] == 0 and health["prefill"][0]["healthy"] is True
    assert messages[0]["status"] == 499


async def test_disconnect_while_decoding_aborts_d() -> None:
    fleet = Fleet()
    fleet[D1].hold = True
    gone = asyncio.Event()
    fleet.on_request = lambda call: call.url == D1 and asyncio.get_running_loop().call_later(0.05, gone.set)
    async with running(config(), fleet) as (app, client):
        await asgi_stream(app, {"prompt": [1]}, disconnect=gone)
        health = await _health(client)
    assert fleet[D1].cancelled == 1 and health["decode"][0]["outstanding"] == 0


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
@pytest.mark.parametrize("prompts", [[1], [[1], [2]]])
async def test_disconnect_mid_stream_closes_every_upstream(spec_version: str, prompts: list) -> None:
    fleet = Fleet()
    fleet[D1].stream_factory = lambda: ChunkStream([sse({"choices": [{"index": 0, "text": "t"}]})] * 200, delay_s=0.01)
    async with running(config(), fleet) as (app, client):
        _, chunks = await asgi_stream(app, {"prompt": prompts, "stream": True}, disconnect_after=3, spec_version=spec_version)
        text = await _metrics(client)
        health = await _health(client)
    assert 3 <= len(chunks) < 100
    streams = fleet[D1].streams
    assert len(streams) == (1 if prompts == [1] else 2)
    assert all(s.closed and s.sent < 200 for s in streams)
    assert health["decode"][0]["outstanding"] == 0
    assert metric_value(text, "kvc_proxy_requests_total", route="/v1/completions", outcome="client_disconnected") == 1
