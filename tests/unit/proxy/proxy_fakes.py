"""Fake vLLM prefill/decode servers behind one httpx.MockTransport, and helpers to run the proxy app in-loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

import kv_connectors.proxy  # examples/ is on pytest's pythonpath (pyproject.toml)
from kv_connectors.proxy.config import BackendSpec, ProxyConfig, SideChannel
from kvc_testing.procs import free_port

P1, P2 = "http://p1.test:8100", "http://p2.test:8100"
D1, D2 = "http://d1.test:8200", "http://d2.test:8200"
KV_FROM_P = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "eng-p",
    "remote_block_ids": [3, 4],
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
}
PROMPT_IDS = [1, 17, 42]


def sse(obj: dict[str, Any] | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


def text_chunks(texts: list[str], usage: dict[str, int] | None = None) -> list[bytes]:
    chunks = [sse({"id": "cmpl-d", "object": "text_completion", "choices": [{"index": 0, "text": t}]}) for t in texts]
    if usage is not None:
        chunks.append(sse({"id": "cmpl-d", "object": "text_completion", "choices": [], "usage": usage}))
    return chunks + [sse("[DONE]")]


class ChunkStream(httpx.AsyncByteStream):
    """A D response body that yields chunks (optionally slowly, optionally failing) and records its closing;
    `close_fail`: closing it raises that (as httpx lets httpcore's errors out of a response's close)."""

    def __init__(
        self,
        chunks: list[bytes],
        delay_s: float = 0.0,
        fail: Exception | None = None,
        fail_first: bool = False,
        close_fail: Exception | None = None,
    ) -> None:
        self.chunks, self.delay_s, self.fail, self.fail_first = chunks, delay_s, fail, fail_first
        self.close_fail = close_fail
        self.sent = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.fail_first and self.fail is not None:
            raise self.fail
        for chunk in self.chunks:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            self.sent += 1
            yield chunk
        if self.fail is not None:
            raise self.fail

    async def aclose(self) -> None:
        self.closed = True
        if self.close_fail is not None:
            raise self.close_fail


@dataclass
class Call:
    url: str
    path: str
    headers: httpx.Headers
    body: Any


@dataclass
class FakeServer:
    """One fake backend. Set `error` (raised), `status` (non-200 answer), `delay_s`, `hold` (wait forever),
    `stream_factory` (D's stream), `body_factory` (the body of its JSON answer), `health` (GET /health
    answers 200 if True, else refuses)."""

    url: str
    role: str
    error: Exception | None = None
    error_times: int = 1_000_000  # how many requests fail with `error`
    status: int = 200
    status_times: int = 1_000_000  # how many requests get `status`
    delay_s: float = 0.0
    hold: bool = False
    health: bool = True
    answer: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    stream_factory: Callable[[], ChunkStream] | None = None
    body_factory: Callable[[], ChunkStream] | None = None  # the body of a JSON (not streamed) answer
    started: int = 0
    cancelled: int = 0
    streams: list[ChunkStream] = field(default_factory=list)
    arrived: asyncio.Event | None = None


class Fleet:
    """Fake P and D servers; records every completion request they get (health checks apart)."""

    def __init__(self, prefill: tuple[str, ...] = (P1,), decode: tuple[str, ...] = (D1,)) -> None:
        self.servers = {u: FakeServer(u, "prefill") for u in prefill} | {u: FakeServer(u, "decode") for u in decode}
        self.calls: list[Call] = []
        self.health_calls = 0
        self.tokenize_calls: list[dict[str, Any]] = []
        self.tokenize_status = 200
        self.on_request: Callable[[Call], Any] | None = None

    def __getitem__(self, url: str) -> FakeServer:
        return self.servers[url]

    def bodies(self, role_or_url: str) -> list[Any]:
        return [c.body for c in self.calls if c.url == role_or_url or self.servers[c.url].role == role_or_url]

    def urls(self) -> list[str]:
        return [c.url for c in self.calls]

    async def handler(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        server = self.servers[base]
        if request.url.path == "/health":
            self.health_calls += 1
            if not server.health:
                raise httpx.ConnectError("connection refused")
            return httpx.Response(200)
        if request.url.path == "/tokenize":  # one token per word, 3 more for a chat template
            self.tokenize_calls.append(json.loads(request.content))
            if self.tokenize_status != 200:
                return httpx.Response(self.tokenize_status, json={"error": {"message": "no", "code": self.tokenize_status}})
            body = self.tokenize_calls[-1]
            if "messages" in body:
                count = sum(len(str(m.get("content", "")).split()) for m in body["messages"]) + 3
            else:
                count = len(body["prompt"].split())
            return httpx.Response(200, json={"count": count, "max_model_len": 4096, "tokens": list(range(count))})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake", "from": base}]})
        body = json.loads(request.content) if request.content else None
        call = Call(base, request.url.path, request.headers, body)
        self.calls.append(call)
        server.started += 1
        if self.on_request is not None:
            self.on_request(call)
        try:
            return await self._answer(server, request.url.path, body)
        except asyncio.CancelledError:
            server.cancelled += 1
            raise

    async def _answer(self, server: FakeServer, path: str, body: dict[str, Any]) -> httpx.Response:
        if server.delay_s:
            await asyncio.sleep(server.delay_s)
        if server.hold:
            await asyncio.Event().wait()
        if server.error is not None and server.error_times > 0:
            server.error_times -= 1
            raise server.error
        if server.status != 200 and server.status_times > 0:
            server.status_times -= 1
            return httpx.Response(server.status, json={"error": {"message": f"{server.role} failed", "code": server.status}})
        if server.answer is not None:
            return httpx.Response(200, json=server.answer(body))
        if server.role == "prefill":
            return httpx.Response(200, json=prefill_answer(path, body))
        if body.get("stream"):
            stream = server.stream_factory() if server.stream_factory else ChunkStream(text_chunks(["a", "b"]))
            server.streams.append(stream)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)
        if server.body_factory is not None:
            stream = server.body_factory()
            server.streams.append(stream)
            return httpx.Response(200, headers={"content-type": "application/json"}, stream=stream)
        return httpx.Response(200, json=decode_answer(server.url, body))


def prefill_answer(path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = {"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": KV_FROM_P}
    if body.get("return_token_ids"):
        if path.endswith("/chat/completions"):
            answer["prompt_token_ids"] = PROMPT_IDS
        else:
            answer["choices"][0]["prompt_token_ids"] = PROMPT_IDS
    return answer


def decode_answer(url: str, body: dict[str, Any]) -> dict[str, Any]:
    prompt = body.get("prompt")
    return {
        "id": "cmpl-d",
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": f"decoded({prompt!r})", "from": url}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def config(
    prefill: tuple[str, ...] = (P1,), decode: tuple[str, ...] = (D1,), side_channels: dict[str, str] | None = None, **kwargs: Any
) -> ProxyConfig:
    def spec(url: str) -> BackendSpec:
        sc = (side_channels or {}).get(url)
        host, port = sc.rsplit(":", 1) if sc else ("", "0")
        return BackendSpec(url, SideChannel(host, int(port)) if sc else None)

    return ProxyConfig(prefill=tuple(spec(u) for u in prefill), decode=tuple(BackendSpec(u) for u in decode), **kwargs)


SIDE_CHANNELS = {P1: "10.0.0.1:5710", P2: "10.0.0.2:5711"}  # P's side channels: with them the proxy runs the transfer-id flow


def tid_config(prefill: tuple[str, ...] = (P1,), decode: tuple[str, ...] = (D1,), **kwargs: Any):
    cfg = config(prefill, decode, side_channels=SIDE_CHANNELS, **kwargs)
    assert cfg.resolved_flow.value == "transfer-id"  # auto: every P has a side channel
    return cfg


@asynccontextmanager
async def running(cfg: ProxyConfig, fleet: Fleet, health_checks: bool = False) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The proxy app with its lifespan running in this loop, and a client talking to it over ASGI."""
    app = kv_connectors.proxy.build_app(cfg, transport=httpx.MockTransport(fleet.handler), health_checks=health_checks)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy", timeout=10) as client:
            yield app, client


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0.0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        metric, _, rest = key.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if metric == name and got == want:
            return float(value)
    return 0.0


async def asgi_stream(
    app: Any,
    body: dict[str, Any],
    disconnect: asyncio.Event | None = None,
    disconnect_after: int | None = None,
    path: str = "/v1/completions",
    spec_version: str = "2.3",
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Drive the app over raw ASGI (lifespan must already run). The client goes away when `disconnect` is set
    or after `disconnect_after` body chunks. Returns the messages sent and the body chunks."""
    request = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
    }
    gone = disconnect or asyncio.Event()
    messages: list[dict[str, Any]] = []
    chunks: list[bytes] = []
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
        messages.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if disconnect_after is not None and len(chunks) >= disconnect_after:
                gone.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return messages, chunks


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run `app` under uvicorn in a thread on a free port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
