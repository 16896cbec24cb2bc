"""Unit tests for examples/proxy.py against fake P/D backends (httpx.MockTransport), no vLLM."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

_PROXY_PATH = Path(__file__).resolve().parents[2] / "examples" / "proxy.py"


def _load_proxy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kv_connectors_example_proxy", _PROXY_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


proxy = _load_proxy()

P1, P2 = "http://p1.test:8100", "http://p2.test:8100"
D1, D2 = "http://d1.test:8200", "http://d2.test:8200"
KV_FROM_P = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-p",
             "remote_block_ids": [3, 4], "remote_host": "10.0.0.1", "remote_port": 5600}
SSE_CHUNKS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
              b"data: [DONE]\n\n"]


class ChunkStream(httpx.AsyncByteStream):
    """A D response body that yields chunks slowly and records whether the proxy closed it."""

    def __init__(self, chunks: list[bytes], delay_s: float = 0.0, fail: Exception | None = None) -> None:
        self.chunks, self.delay_s, self.fail = chunks, delay_s, fail
        self.sent = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            self.sent += 1
            yield chunk
        if self.fail is not None:
            raise self.fail

    async def aclose(self) -> None:
        self.closed = True


class Fakes:
    """Fake P and D servers behind one MockTransport; records every request they get."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, httpx.Headers, Any]] = []
        self.p_kv: dict[str, Any] | None = KV_FROM_P
        self.p_error: Exception | None = None
        self.p_status, self.d_status = 200, 200
        self.d_stream: ChunkStream | None = None

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        self.calls.append((base, request.url.path, request.headers, body))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake", "from": base}]})
        if base in (P1, P2):
            return self._prefill()
        return self._decode(body)

    def _prefill(self) -> httpx.Response:
        if self.p_error is not None:
            raise self.p_error
        if self.p_status != 200:
            return httpx.Response(self.p_status, json={"error": {"message": "bad model", "code": self.p_status}})
        body: dict[str, Any] = {"id": "cmpl-p", "choices": [{"text": "x"}]}
        if self.p_kv is not None:
            body["kv_transfer_params"] = self.p_kv
        return httpx.Response(200, json=body)

    def _decode(self, body: dict[str, Any]) -> httpx.Response:
        if self.d_status != 200:
            return httpx.Response(self.d_status, json={"error": {"message": "d failed", "code": self.d_status}})
        if body.get("stream"):
            self.d_stream = self.d_stream or ChunkStream(SSE_CHUNKS)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=self.d_stream)
        return httpx.Response(200, json={"id": "cmpl-d", "choices": [{"text": "decoded"}]})

    def bodies(self, base_prefix: str) -> list[Any]:
        return [body for base, _, _, body in self.calls if base.startswith(base_prefix)]

    def headers(self, base_prefix: str) -> list[httpx.Headers]:
        return [headers for base, _, headers, _ in self.calls if base.startswith(base_prefix)]


@pytest.fixture
def fakes() -> Fakes:
    return Fakes()


@pytest.fixture
def client(fakes: Fakes) -> Iterator[TestClient]:
    app = proxy.build_app([P1], [D1], timeout_s=5, transport=httpx.MockTransport(fakes.handler))
    with TestClient(app) as test_client:
        yield test_client


def _assert_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


def test_prefill_and_decode_requests(client: TestClient, fakes: Fakes) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 16, "min_tokens": 4, "stream": False,
            "stream_options": {"include_usage": True}, "temperature": 0}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200 and resp.json()["id"] == "cmpl-d"
    [p_body], [d_body] = fakes.bodies("http://p"), fakes.bodies("http://d")
    assert p_body["kv_transfer_params"] == proxy.PREFILL_KV_PARAMS
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body and "min_tokens" not in p_body
    assert p_body["prompt"] == "hello" and p_body["temperature"] == 0
    assert d_body == {**body, "kv_transfer_params": KV_FROM_P}
    assert [path for _, path, _, _ in fakes.calls] == ["/v1/completions"] * 2


def test_chat_max_completion_tokens(client: TestClient, fakes: Fakes) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    [p_body], [d_body] = fakes.bodies("http://p"), fakes.bodies("http://d")
    assert p_body["max_completion_tokens"] == 1 and p_body["max_tokens"] == 1
    assert d_body["max_completion_tokens"] == 9 and "max_tokens" not in d_body
    assert {path for _, path, _, _ in fakes.calls} == {"/v1/chat/completions"}


def test_streaming_passthrough(client: TestClient, fakes: Fakes) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        data = b"".join(resp.iter_bytes())
    assert data == b"".join(SSE_CHUNKS)
    [p_body], [d_body] = fakes.bodies("http://p"), fakes.bodies("http://d")
    assert p_body["stream"] is False and "stream_options" not in p_body
    assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}
    assert d_body["max_tokens"] == 8 and d_body["kv_transfer_params"] == KV_FROM_P
    assert fakes.d_stream is not None and fakes.d_stream.closed


def test_request_id_propagated(client: TestClient, fakes: Fakes) -> None:
    resp = client.post("/v1/completions", json={"prompt": "a"}, headers={"X-Request-Id": "rid-42"})
    assert resp.headers["x-request-id"] == "rid-42"
    assert [h["x-request-id"] for h in fakes.headers("http://")] == ["rid-42", "rid-42"]
    fakes.calls.clear()
    resp = client.post("/v1/completions", json={"prompt": "a"})
    generated = resp.headers["x-request-id"]
    assert generated and [h["x-request-id"] for h in fakes.headers("http://")] == [generated] * 2


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"text"', b""])
def test_invalid_json_is_400(client: TestClient, fakes: Fakes, raw: bytes) -> None:
    resp = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert _assert_error(resp, 400)["type"] == "invalid_request_error"
    assert fakes.calls == []


def test_prefill_down_is_502(client: TestClient, fakes: Fakes) -> None:
    fakes.p_error = httpx.ConnectError("connection refused")
    error = _assert_error(client.post("/v1/completions", json={"prompt": "a"}), 502)
    assert P1 in error["message"] and "prefill" in error["message"]
    assert fakes.bodies("http://d") == []


def test_prefill_timeout_is_504(client: TestClient, fakes: Fakes) -> None:
    fakes.p_error = httpx.ReadTimeout("timed out")
    error = _assert_error(client.post("/v1/completions", json={"prompt": "a"}), 504)
    assert "timed out" in error["message"]


def test_prefill_without_kv_params_still_decodes(client: TestClient, fakes: Fakes) -> None:
    fakes.p_kv = None
    body = {"prompt": "a", "kv_transfer_params": {"client": "junk"}}
    assert client.post("/v1/completions", json=body).status_code == 200
    [d_body] = fakes.bodies("http://d")
    assert "kv_transfer_params" not in d_body


def test_backend_http_errors(client: TestClient, fakes: Fakes) -> None:
    fakes.d_status = 400
    resp = client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "d failed"
    fakes.d_status = 500
    _assert_error(client.post("/v1/completions", json={"prompt": "a"}), 502)
    _assert_error(client.post("/v1/completions", json={"prompt": "a", "stream": True}), 502)
    fakes.p_status = 503
    _assert_error(client.post("/v1/completions", json={"prompt": "a"}), 502)
    fakes.p_status = 404  # P rejects the request itself: the client sees P's own 4xx
    resp = client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status_code == 404 and resp.json()["error"]["message"] == "bad model"


def test_round_robin(fakes: Fakes) -> None:
    app = proxy.build_app([P1, P2], [D1 + "/", D2], transport=httpx.MockTransport(fakes.handler))
    with TestClient(app) as test_client:
        for _ in range(4):
            assert test_client.post("/v1/completions", json={"prompt": "a"}).status_code == 200
    order = [base for base, _, _, _ in fakes.calls]
    assert order == [P1, D1, P2, D2, P1, D1, P2, D2]


def test_models_and_health(fakes: Fakes) -> None:
    app = proxy.build_app([P1], [D2, D1], transport=httpx.MockTransport(fakes.handler))
    with TestClient(app) as test_client:
        models = test_client.get("/v1/models")
        health = test_client.get("/health")
    assert models.status_code == 200 and models.json()["data"][0]["from"] == D2
    assert health.status_code == 200 and health.json() == {"status": "ok", "prefill": [P1], "decode": [D2, D1]}


def test_one_log_line_per_request(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kv_connectors.proxy"):
        client.post("/v1/completions", json={"prompt": "a"}, headers={"X-Request-Id": "rid-log"})
    lines = [r.getMessage() for r in caplog.records if "rid-log" in r.getMessage()]
    assert len(lines) == 1
    assert P1 in lines[0] and D1 in lines[0] and "prefill=" in lines[0] and "total=" in lines[0]


def test_build_app_validates() -> None:
    with pytest.raises(ValueError):
        proxy.build_app([], [D1])
    with pytest.raises(ValueError):
        proxy.build_app([P1], [D1], timeout_s=0)
    with pytest.raises(ValueError):
        proxy.build_app(["ftp://x"], [D1])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_real_network_refused_and_timeout() -> None:
    """Without a fake transport: a closed port gives 502; a server that never answers gives 504."""
    with socket.socket() as silent:  # listens (kernel completes the handshake) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for p_url, status in ((f"http://127.0.0.1:{_free_port()}", 502), (silent_url, 504)):
            with TestClient(proxy.build_app([p_url], [D1], timeout_s=0.5)) as test_client:
                _assert_error(test_client.post("/v1/completions", json={"prompt": "a"}), status)


async def _asgi_stream(app: FastAPI, disconnect_after: int | None, spec_version: str = "2.3") -> list[bytes]:
    """Drive the app over raw ASGI; the client disconnects after `disconnect_after` body chunks.

    ASGI spec 2.3 servers report the disconnect through receive(); from 2.4 send() raises OSError.
    """
    request = json.dumps({"prompt": "a", "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 8000)}
    chunks: list[bytes] = []
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set() and spec_version == "2.4":
            raise OSError("client went away")
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if disconnect_after is not None and len(chunks) >= disconnect_after:
                gone.set()

    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return chunks


def test_stream_is_chunk_by_chunk(fakes: Fakes) -> None:
    app = proxy.build_app([P1], [D1], transport=httpx.MockTransport(fakes.handler))
    assert asyncio.run(_asgi_stream(app, disconnect_after=None)) == SSE_CHUNKS


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_client_disconnect_closes_upstream(fakes: Fakes, spec_version: str) -> None:
    fakes.d_stream = ChunkStream([b"data: {}\n\n"] * 200, delay_s=0.01)
    app = proxy.build_app([P1], [D1], transport=httpx.MockTransport(fakes.handler))
    chunks = asyncio.run(_asgi_stream(app, disconnect_after=3, spec_version=spec_version))
    assert 3 <= len(chunks) < 200
    assert fakes.d_stream.closed and fakes.d_stream.sent < 200


def test_decode_failure_mid_stream_ends_with_sse_error(fakes: Fakes) -> None:
    fakes.d_stream = ChunkStream(SSE_CHUNKS[:1], fail=httpx.ReadError("connection reset"))
    app = proxy.build_app([P1], [D1], transport=httpx.MockTransport(fakes.handler))
    chunks = asyncio.run(_asgi_stream(app, disconnect_after=None))
    assert chunks[0] == SSE_CHUNKS[0] and chunks[-1].endswith(b"data: [DONE]\n\n")
    error = json.loads(chunks[-1].split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and "mid-stream" in error["message"]
