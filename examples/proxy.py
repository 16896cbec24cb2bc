"""Example PD proxy: prefill on P with do_remote_decode, then decode on D with P's kv_transfer_params."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("kv_connectors.proxy")

REQUEST_ID_HEADER = "X-Request-Id"
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
PREFILL_KV_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                      "remote_block_ids": None, "remote_host": None, "remote_port": None}
_EXCERPT_CHARS = 300


@dataclass
class ProxyState:
    """Per-app proxy state: backend lists, round-robin cursors and the shared HTTP client."""

    prefill_urls: list[str]
    decode_urls: list[str]
    timeout_s: float
    client: httpx.AsyncClient | None = None
    _prefill_cycle: Iterator[str] = field(init=False, repr=False)
    _decode_cycle: Iterator[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._prefill_cycle = itertools.cycle(self.prefill_urls)
        self._decode_cycle = itertools.cycle(self.decode_urls)

    def next_pair(self) -> tuple[str, str]:
        """Next (prefill, decode) base URLs, round-robin over each list independently."""
        return next(self._prefill_cycle), next(self._decode_cycle)

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("proxy HTTP client not started (app lifespan has not run)")
        return self.client


@dataclass
class RequestLog:
    """Timings of one proxied request, logged as a single line when it ends."""

    request_id: str
    path: str
    start: float = field(default_factory=time.perf_counter)
    prefill_url: str = "-"
    decode_url: str = "-"
    prefill_s: float | None = None
    outcome: str = "done"

    def emit(self, status: int) -> None:
        prefill = "-" if self.prefill_s is None else f"{self.prefill_s:.3f}s"
        logger.info(
            "request %s %s P=%s D=%s status=%d %s prefill=%s total=%.3fs",
            self.request_id, self.path, self.prefill_url, self.decode_url, status,
            self.outcome, prefill, time.perf_counter() - self.start,
        )


class ProxyError(Exception):
    """Aborts a request with a ready-made response for the client."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "code": status}}


def error_response(status: int, message: str, err_type: str) -> JSONResponse:
    """An OpenAI-style error body: {"error": {"message", "type", "code"}}."""
    return JSONResponse(_error_body(status, message, err_type), status_code=status)


def _transport_error(role: str, url: str, exc: Exception) -> ProxyError:
    if isinstance(exc, httpx.TimeoutException):
        msg = f"{role} server {url} timed out ({type(exc).__name__})"
        return ProxyError(error_response(504, msg, "upstream_timeout"))
    msg = f"{role} server {url} failed: {type(exc).__name__}: {exc}"
    return ProxyError(error_response(502, msg, "upstream_error"))


def _check_upstream(role: str, url: str, resp: httpx.Response) -> None:
    """Raise ProxyError unless `resp` (already read) is 2xx; 4xx JSON bodies pass through as-is."""
    if resp.is_success:
        return
    status = resp.status_code
    client_error = 400 <= status < 500
    if client_error:
        with contextlib.suppress(ValueError):
            resp.json()
            raise ProxyError(Response(resp.content, status_code=status, media_type="application/json"))
    msg = f"{role} server {url} returned HTTP {status}: {resp.text[:_EXCERPT_CHARS]}"
    raise ProxyError(error_response(status if client_error else 502, msg, "upstream_error"))


def _normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"invalid backend URL: {url!r}")
    return url


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The P request: generate one token, no streaming, and keep the KV blocks for remote decode."""
    p_body = dict(body)
    p_body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    p_body["stream"] = False
    p_body["max_tokens"] = 1
    if "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        p_body.pop(key, None)
    return p_body


def decode_body(body: dict[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The D request: the client's body plus P's kv_transfer_params (dropped when P returned none)."""
    d_body = dict(body)
    d_body.pop("kv_transfer_params", None)
    if kv_params is not None:
        d_body["kv_transfer_params"] = kv_params
    return d_body


async def _read_json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ProxyError(error_response(400, f"invalid JSON body: {exc}", "invalid_request_error")) from exc
    if not isinstance(body, dict):
        raise ProxyError(error_response(400, "request body must be a JSON object", "invalid_request_error"))
    return body


async def _prefill(
    state: ProxyState, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any] | None:
    try:
        resp = await state.http().post(url, json=prefill_body(body), headers=headers)
    except httpx.HTTPError as exc:
        raise _transport_error("prefill", url, exc) from exc
    _check_upstream("prefill", url, resp)
    try:
        data = resp.json()
    except ValueError as exc:
        msg = f"prefill server {url} returned a non-JSON body: {resp.text[:_EXCERPT_CHARS]}"
        raise ProxyError(error_response(502, msg, "upstream_error")) from exc
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return params if isinstance(params, dict) else None


async def _decode_json(
    state: ProxyState, url: str, body: dict[str, Any], headers: dict[str, str]
) -> Response:
    try:
        resp = await state.http().post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise _transport_error("decode", url, exc) from exc
    _check_upstream("decode", url, resp)
    media_type = resp.headers.get("content-type", "application/json")
    return Response(resp.content, status_code=resp.status_code, media_type=media_type)


async def _relay(upstream: httpx.Response, rec: RequestLog) -> AsyncIterator[bytes]:
    """Yield D's bytes as they arrive; a mid-stream upstream failure ends with an SSE error event."""
    rec.outcome = "client-disconnected"
    try:
        async for chunk in upstream.aiter_bytes():
            yield chunk
    except httpx.HTTPError as exc:
        kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "error"
        rec.outcome = f"upstream-{kind}"
        msg = f"decode server {rec.decode_url} failed mid-stream: {type(exc).__name__}: {exc}"
        logger.warning("request %s: %s", rec.request_id, msg)
        payload = json.dumps(_error_body(504 if kind == "timeout" else 502, msg, f"upstream_{kind}"))
        yield f"data: {payload}\n\ndata: [DONE]\n\n".encode()
    else:
        rec.outcome = "done"


class UpstreamStream(StreamingResponse):
    """SSE passthrough of D's response that always closes the upstream (aborting D) when it ends."""

    def __init__(self, upstream: httpx.Response, rec: RequestLog) -> None:
        self._relay = _relay(upstream, rec)
        media_type = upstream.headers.get("content-type", "text/event-stream")
        super().__init__(self._relay, status_code=upstream.status_code, media_type=media_type,
                         headers={"Cache-Control": "no-cache"})
        self._upstream = upstream
        self._rec = rec

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # ASGI spec >= 2.4 servers: an expected end, not an app error
            pass
        finally:
            with anyio.CancelScope(shield=True):
                await self._relay.aclose()
                await self._upstream.aclose()
            self._rec.emit(self.status_code)


async def _decode_stream(
    state: ProxyState, url: str, body: dict[str, Any], headers: dict[str, str], rec: RequestLog
) -> UpstreamStream:
    client = state.http()
    try:
        resp = await client.send(client.build_request("POST", url, json=body, headers=headers), stream=True)
    except httpx.HTTPError as exc:
        raise _transport_error("decode", url, exc) from exc
    if not resp.is_success:
        try:
            await resp.aread()
        except httpx.HTTPError as exc:
            raise _transport_error("decode", url, exc) from exc
        finally:
            await resp.aclose()
        _check_upstream("decode", url, resp)
    return UpstreamStream(resp, rec)


def _forward_headers(request: Request, request_id: str) -> dict[str, str]:
    headers = {REQUEST_ID_HEADER: request_id}
    if auth := request.headers.get("authorization"):
        headers["Authorization"] = auth
    return headers


async def _proxy_completion(state: ProxyState, request: Request, path: str, rec: RequestLog) -> Response:
    body = await _read_json_object(request)
    p_base, d_base = state.next_pair()
    rec.prefill_url, rec.decode_url = p_base, d_base
    headers = _forward_headers(request, rec.request_id)
    kv_params = await _prefill(state, p_base + path, body, headers)
    rec.prefill_s = time.perf_counter() - rec.start
    if kv_params is None:
        logger.warning("request %s: prefill %s returned no kv_transfer_params; decode %s recomputes the prompt",
                       rec.request_id, p_base, d_base)
    d_body = decode_body(body, kv_params)
    if body.get("stream"):
        return await _decode_stream(state, d_base + path, d_body, headers, rec)
    return await _decode_json(state, d_base + path, d_body, headers)


def _completion_endpoint(path: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        state: ProxyState = request.app.state.proxy
        rec = RequestLog(request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex, path)
        try:
            response = await _proxy_completion(state, request, path, rec)
        except ProxyError as exc:
            response = exc.response
        except Exception:
            logger.exception("request %s: unexpected proxy error", rec.request_id)
            response = error_response(500, "internal proxy error (see proxy log)", "internal_error")
        response.headers[REQUEST_ID_HEADER] = rec.request_id
        if not isinstance(response, UpstreamStream):  # a stream logs when it ends
            rec.emit(response.status_code)
        return response

    return endpoint


async def _models(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    url = state.decode_urls[0] + "/v1/models"
    headers = {"Authorization": auth} if (auth := request.headers.get("authorization")) else {}
    try:
        resp = await state.http().get(url, headers=headers)
    except httpx.HTTPError as exc:
        return _transport_error("decode", url, exc).response
    return Response(resp.content, status_code=resp.status_code,
                    media_type=resp.headers.get("content-type", "application/json"))


async def _health(request: Request) -> JSONResponse:
    state: ProxyState = request.app.state.proxy
    return JSONResponse({"status": "ok", "prefill": state.prefill_urls, "decode": state.decode_urls})


def build_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    timeout_s: float = 120.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """Build the proxy app; `transport` (e.g. httpx.MockTransport) replaces the network in tests."""
    if not prefill_urls or not decode_urls:
        raise ValueError("need at least one prefill URL and one decode URL")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    state = ProxyState([_normalize_url(u) for u in prefill_urls], [_normalize_url(u) for u in decode_urls],
                       float(timeout_s))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # trust_env=False: backends are reached directly, never through $HTTP_PROXY.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout_s),
                                     limits=limits, trust_env=False) as client:
            state.client = client
            try:
                yield
            finally:
                state.client = None

    app = FastAPI(title="kv_connectors PD proxy", lifespan=lifespan)
    app.state.proxy = state
    for path in COMPLETION_PATHS:
        app.add_api_route(path, _completion_endpoint(path), methods=["POST"])
    app.add_api_route("/v1/models", _models, methods=["GET"])
    app.add_api_route("/health", _health, methods=["GET"])
    return app


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="prefill server base URL, e.g. http://127.0.0.1:8100 (repeatable)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="decode server base URL (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="per-operation upstream timeout: connect, and each read (gap between stream chunks)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # keep one log line per request
    app = build_app(args.prefill, args.decode, args.timeout_s)
    state: ProxyState = app.state.proxy
    logger.info("proxy on http://%s:%d prefill=%s decode=%s", args.host, args.port, state.prefill_urls,
                state.decode_urls)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
