"""A decode server that dies mid-request never costs the client "internal proxy error": before any byte of
its answer reached the client the prompt is retried on another D (P again where D may have read its KV),
after that the stream ends with an SSE error event; either way the outcome is counted.

Two fakes: a D on a real socket that dies at each point of its answer (FIN or RST, behind the real proxy
app under uvicorn), and D's answers through httpx.MockTransport failing with the errors httpx lets through
from below it (httpcore's, anyio's, the OS's: encode/httpx#1463, a response's close), at each point."""

from __future__ import annotations

import json

import anyio
import httpcore
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import kv_connectors.proxy
from tests.unit.proxy.dying_upstream import JSON_BODY, Death, DyingServer
from tests.unit.proxy.proxy_fakes import (
    D1,
    D2,
    KV_FROM_P,
    P1,
    ChunkStream,
    Fleet,
    asgi_stream,
    config,
    metric_value,
    running,
    serve,
    text_chunks,
)

OUTCOMES = ("ok", "upstream_error", "upstream_timeout", "failed_mid_stream", "no_backend", "internal_error")


def _prefill_app() -> FastAPI:
    app = FastAPI()
    app.add_api_route("/health", lambda: JSONResponse({}), methods=["GET"])

    async def completion(request: Request) -> JSONResponse:
        await request.json()
        return JSONResponse({"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": KV_FROM_P})

    app.add_api_route("/v1/completions", completion, methods=["POST"])
    return app


def _ask(url: str, stream: bool) -> tuple[int, bytes]:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}
    with httpx.Client(timeout=20) as client:
        if not stream:
            resp = client.post(url + "/v1/completions", json=body)
            return resp.status_code, resp.content
        with client.stream("POST", url + "/v1/completions", json=body) as resp:
            return resp.status_code, resp.read()


# (death, stream): what the client gets. Before the first output event nothing reached the client: retried.
MID_STREAM = {(Death.AFTER_EVENTS, True)}
CASES = [
    (death, stream)
    for death in Death
    if death is not Death.NEVER
    for stream in (False, True)
    if not (death is Death.IN_JSON_BODY and stream)  # a JSON answer to a streamed request: relayed as it comes
    and not (death in (Death.SSE_HEAD_ONLY, Death.IN_FIRST_CHUNK, Death.AFTER_EVENTS) and not stream)
]


@pytest.mark.parametrize("rst", [False, True], ids=["fin", "rst"])
@pytest.mark.parametrize(("death", "stream"), CASES, ids=[f"{d.value}-{'stream' if s else 'json'}" for d, s in CASES])
def test_decode_dying_at_each_point_is_retried_or_a_counted_stream_error(death: Death, stream: bool, rst: bool) -> None:
    dying, healthy = DyingServer(death, rst), DyingServer(Death.NEVER)
    with serve(_prefill_app()) as p_url, dying.running(), healthy.running():
        cfg = config((p_url,), (dying.url, healthy.url), max_retries=2)
        with serve(kv_connectors.proxy.build_app(cfg, health_checks=False)) as proxy:
            status, body = _ask(proxy, stream)
            metrics = httpx.get(proxy + "/metrics").text
    counted = {o: metric_value(metrics, "kvc_proxy_requests_total", route="/v1/completions", outcome=o) for o in OUTCOMES}
    assert status == 200, body
    assert death is Death.REFUSED or dying.requests == 1
    if (death, stream) in MID_STREAM:
        events = [json.loads(e.removeprefix(b"data: ")) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
        assert [e["choices"][0]["text"] for e in events[:-1]] == ["t", "t"]
        assert events[-1]["error"]["code"] == 502 and "mid-stream" in events[-1]["error"]["message"], events[-1]
        assert body.endswith(b"data: [DONE]\n\n")
        assert counted == {**dict.fromkeys(OUTCOMES, 0.0), "failed_mid_stream": 1.0}
        return
    assert healthy.requests == 1
    assert (b'"text": "t"' in body and body.endswith(b"data: [DONE]\n\n")) if stream else body == JSON_BODY
    assert counted == {**dict.fromkeys(OUTCOMES, 0.0), "ok": 1.0}
    assert metric_value(metrics, "kvc_proxy_retries_total", role="decode") == 1


# The errors httpx lets through from below it, as a dying connection raises them.
FOREIGN = {
    "httpcore.ReadError": lambda: httpcore.ReadError("[Errno 104] Connection reset by peer"),
    "anyio.BrokenResourceError": lambda: anyio.BrokenResourceError(),
    "ConnectionResetError": lambda: ConnectionResetError(104, "Connection reset by peer"),
}
POINTS = ("send", "first_read", "close")  # raised instead of an answer, on the body's first read, on its close


def _fail_d1(fleet: Fleet, point: str, make: object, stream: bool) -> None:
    error = make()  # type: ignore[operator]
    d1 = fleet[D1]
    d1.error_times = 1
    if point == "send":
        d1.error = error
        return
    # close: the body's read failed as httpx reports it, and closing the response raised the foreign error.
    read_error, close_error = (error, None) if point == "first_read" else (httpx.ReadError("connection reset"), error)
    factory = lambda: ChunkStream([], fail=read_error, fail_first=True, close_fail=close_error)  # noqa: E731
    if stream:
        d1.stream_factory = factory
    else:
        d1.body_factory = factory


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("error", list(FOREIGN))
async def test_foreign_error_before_the_first_byte_is_retried_on_another_decode(error: str, point: str, stream: bool) -> None:
    fleet = Fleet((P1,), (D1, D2))
    _fail_d1(fleet, point, FOREIGN[error], stream)
    async with running(config(decode=(D1, D2)), fleet) as (app, client):
        if stream:
            messages, chunks = await asgi_stream(app, {"prompt": [1], "stream": True})
            status, body = messages[0]["status"], b"".join(chunks)
        else:
            resp = await client.post("/v1/completions", json={"prompt": [1]})
            status, body = resp.status_code, resp.content
        metrics = (await client.get("/metrics")).text
        health = (await client.get("/health")).json()
    assert status == 200, body
    assert fleet.urls() == [P1, D1, P1, D2]  # D may have read P's KV: P again, then the other D
    if stream:
        assert body == b"".join(text_chunks(["a", "b"]))
    else:
        assert json.loads(body)["choices"][0]["from"] == D2
    assert metric_value(metrics, "kvc_proxy_requests_total", route="/v1/completions", outcome="ok") == 1
    assert metric_value(metrics, "kvc_proxy_requests_total", route="/v1/completions", outcome="internal_error") == 0
    assert metric_value(metrics, "kvc_proxy_retries_total", role="decode") == 1
    assert [b["healthy"] for b in health["decode"]] == [False, True]  # a dropped connection evicts at once


@pytest.mark.anyio
@pytest.mark.parametrize("error", list(FOREIGN))
async def test_foreign_error_mid_stream_ends_with_an_sse_error_counted(error: str) -> None:
    fleet = Fleet((P1,), (D1,))
    first = text_chunks(["a"])[0]
    fleet[D1].stream_factory = lambda: ChunkStream([first], fail=FOREIGN[error](), close_fail=FOREIGN[error]())
    async with running(config(), fleet) as (app, client):
        messages, chunks = await asgi_stream(app, {"prompt": [1], "stream": True})
        metrics = (await client.get("/metrics")).text
    assert messages[0]["status"] == 200 and chunks[0] == first and chunks[-1].endswith(b"data: [DONE]\n\n")
    event = json.loads(chunks[-1].split(b"\n\n")[0].removeprefix(b"data: "))
    assert event["error"]["code"] == 502 and "mid-stream" in event["error"]["message"] and D1 in event["error"]["message"]
    assert metric_value(metrics, "kvc_proxy_requests_total", route="/v1/completions", outcome="failed_mid_stream") == 1
    assert fleet[D1].streams[0].closed


@pytest.mark.anyio
@pytest.mark.parametrize("error", list(FOREIGN))
async def test_foreign_error_on_the_last_decode_is_a_counted_502(error: str) -> None:
    fleet = Fleet((P1,), (D1,))
    fleet[D1].error = FOREIGN[error]()
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1]})
        metrics = (await client.get("/metrics")).text
    assert resp.status_code == 502, resp.text
    assert D1 in resp.json()["error"]["message"] and resp.json()["error"]["type"] == "upstream_error"
    assert metric_value(metrics, "kvc_proxy_requests_total", route="/v1/completions", outcome="upstream_error") == 1
