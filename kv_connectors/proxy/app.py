"""The proxy's HTTP app: completion routes, /v1/models, /health, /metrics; build_app() and main()."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from . import admin, bodies
from .backends import HealthChecker
from .config import ProxyConfig, Role
from .context import ProxyContext
from .dispatch import REQUEST_ID_HEADER, dispatch
from .errors import Outcome, ProxyError, error_response
from .flags import parse_args
from .metrics import CONTENT_TYPE
from .relay import RelayResponse
from .trace import Trace
from .upstream import classify

logger = logging.getLogger("kv_connectors.proxy")
CLIENT_CLOSED_STATUS = 499  # never delivered: the client is gone


class _ClientGone(Exception):
    pass


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `max_bytes`."""
    too_large = ProxyError(413, f"request body exceeds {max_bytes} bytes", "invalid_request_error", Outcome.TOO_LARGE)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise _ClientGone from exc
    return b"".join(chunks)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`; if the client goes away first, cancel it (closing upstream connections aborts them)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.wait({task, watcher})
    if task.cancelled():
        raise _ClientGone
    return task.result()


def _forward_headers(request: Request, request_id: str) -> dict[str, str]:
    headers = {REQUEST_ID_HEADER: request_id}
    if auth := request.headers.get("authorization"):
        headers["Authorization"] = auth
    return headers


def _completion_endpoint(route: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        ctx: ProxyContext = request.app.state.proxy
        trace = Trace(request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex, route, ctx.metrics)
        try:
            body = bodies.parse_json_object(await read_body(request, ctx.config.max_body_bytes))
            bodies.validate(route, body)
            headers = _forward_headers(request, trace.request_id)
            response = await until_disconnect(request, dispatch(ctx, route, body, headers, trace))
        except ProxyError as exc:
            trace.outcome = exc.outcome
            response = exc.response()
        except _ClientGone:
            trace.outcome = Outcome.CLIENT_DISCONNECTED
            response = Response(status_code=CLIENT_CLOSED_STATUS)
        except Exception:
            logger.exception("request %s: unexpected proxy error", trace.request_id)
            trace.outcome = Outcome.INTERNAL_ERROR
            response = error_response(500, "internal proxy error (see the proxy's log)", "internal_error")
        response.headers[REQUEST_ID_HEADER] = trace.request_id
        if not isinstance(response, RelayResponse):  # a stream logs when it ends
            trace.finish(response.status_code)
        return response

    return endpoint


async def _models(request: Request) -> Response:
    ctx: ProxyContext = request.app.state.proxy
    backend = ctx.decode.pick() or ctx.decode.backends[0]
    headers = {"Authorization": auth} if (auth := request.headers.get("authorization")) else {}
    try:
        resp = await ctx.http().get(backend.url + "/v1/models", headers=headers, timeout=ctx.config.decode_timeout_s)
    except Exception as exc:  # only the HTTP client runs in here
        return classify(Role.DECODE, backend.url, exc).to_proxy_error().response()
    return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type", "application/json"))


async def _health(request: Request) -> JSONResponse:
    """200 while the proxy can serve (a healthy D, and a healthy P unless D may compute prompts itself,
    --decode-only-fallback), else 503; each backend's state either way."""
    ctx: ProxyContext = request.app.state.proxy
    ready = ctx.decode.any_healthy() and (ctx.prefill.any_healthy() or ctx.config.decode_only_fallback)
    body: dict[str, Any] = {
        "status": "ok" if ready else "unavailable",
        "flow": ctx.flow.value,
        "prefill": [b.snapshot() for b in ctx.prefill.backends],
        "decode": [b.snapshot() for b in ctx.decode.backends],
    }
    return JSONResponse(body, status_code=200 if ready else 503)


async def _metrics(request: Request) -> Response:
    ctx: ProxyContext = request.app.state.proxy
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


def build_app(config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None, health_checks: bool = True) -> FastAPI:
    """The proxy app; `transport` (e.g. httpx.MockTransport) replaces the network in tests."""
    ctx = ProxyContext(config)
    checker = HealthChecker(
        [ctx.prefill, ctx.decode], ctx.http, config.health_interval_s, config.health_timeout_s, config.unhealthy_after
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # trust_env=False: backends are reached directly, never through $HTTP_PROXY.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(transport=transport, limits=limits, trust_env=False) as client:
            ctx.client = client
            task = asyncio.create_task(checker.run()) if health_checks else None
            for pool in (ctx.prefill, ctx.decode):
                pool.start_events()
            try:
                yield
            finally:
                for pool in (ctx.prefill, ctx.decode):
                    pool.close_events()
                if task is not None:
                    task.cancel()
                    with suppress(asyncio.CancelledError):
                        await task
                ctx.client = None

    app = FastAPI(title="kv_connectors PD proxy", lifespan=lifespan)
    app.state.proxy = ctx
    app.state.health_checker = checker
    for route in bodies.ROUTES:
        app.add_api_route(route, _completion_endpoint(route), methods=["POST"])
    app.add_api_route("/v1/models", _models, methods=["GET"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    admin.add_routes(app)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.log_level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # keep one log line per request
    app = build_app(config)
    logger.info(
        "proxy on http://%s:%d flow=%s prefill=%s decode=%s",
        config.host,
        config.port,
        config.resolved_flow.value,
        [f"{s.url} ({s.side_channel})" if s.side_channel else s.url for s in config.prefill],
        [s.url for s in config.decode],
    )
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False)
