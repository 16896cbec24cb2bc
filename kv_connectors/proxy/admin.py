"""Runtime fleet changes: add, remove, drain and undrain a backend, behind a bearer token from config."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .backends import Backend, BackendPool
from .bodies import parse_json_object
from .config import ADMIN_TOKEN_ENV, ConfigError, Flow, Role, backend_spec
from .context import ProxyContext
from .errors import Outcome, ProxyError, error_response

logger = logging.getLogger("kv_connectors.proxy")
DRAIN_POLL_S = 0.05
MAX_DRAIN_S = 3600.0
DEFAULT_DRAIN_S = 60.0
_OUTCOME = Outcome.BAD_REQUEST  # what a refused admin request's ProxyError carries (admin requests are not counted)


def _refused(status: int, message: str) -> JSONResponse:
    return error_response(status, message, "admin_error")


def _authorized(ctx: ProxyContext, request: Request) -> JSONResponse | None:
    """None when the request carries the admin token; else the refusal (401 none, 403 wrong or admin off)."""
    token = ctx.config.admin_token
    if not token:
        return _refused(403, f"the admin endpoints are off: start the proxy with ${ADMIN_TOKEN_ENV} (or --admin-token-env) set")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return _refused(401, "missing admin token: send 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        return _refused(403, "wrong admin token")
    return None


async def _body(request: Request) -> dict[str, Any]:
    return parse_json_object(await request.body())


def _role(body: dict[str, Any]) -> Role:
    try:
        return Role(body.get("role"))
    except ValueError:
        raise ProxyError(400, f"'role' must be 'prefill' or 'decode', got {body.get('role')!r}", "admin_error", _OUTCOME) from None


def _str(body: dict[str, Any], name: str, required: bool = True) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ProxyError(400, f"'{name}' must be a non-empty string, got {value!r}", "admin_error", _OUTCOME)
    return value


def _target(ctx: ProxyContext, body: dict[str, Any]) -> tuple[BackendPool, Backend]:
    """The existing backend a request names (404 if the pool has no such URL)."""
    role = _role(body)
    pool = ctx.pool(role)
    try:
        url = backend_spec(role, _str(body, "url") or "").url
    except ConfigError as exc:
        raise ProxyError(400, str(exc), "admin_error", _OUTCOME) from exc
    backend = pool.find(url)
    if backend is None:
        raise ProxyError(404, f"no {role.value} server {url} (have {[b.url for b in pool.backends]})", "admin_error", _OUTCOME)
    return pool, backend


async def add_backend(ctx: ProxyContext, body: dict[str, Any]) -> JSONResponse:
    role = _role(body)
    pool = ctx.pool(role)
    try:
        spec = backend_spec(role, _str(body, "url") or "", _str(body, "side_channel", required=False))
    except ConfigError as exc:
        return _refused(400, str(exc))
    if role is Role.PREFILL and ctx.flow is Flow.TRANSFER_ID and spec.side_channel is None:
        return _refused(400, "this proxy runs the transfer-id flow: a prefill server needs its 'side_channel' (HOST:PORT)")
    if pool.find(spec.url) is not None:
        return _refused(409, f"{role.value} server {spec.url} is already in the pool")
    backend = pool.add(spec)
    ctx.metrics.fleet_changes.labels("add").inc()
    return JSONResponse(backend.snapshot(), status_code=201)


async def remove_backend(ctx: ProxyContext, body: dict[str, Any]) -> JSONResponse:
    pool, backend = _target(ctx, body)
    if pool.role is Role.DECODE and len(pool.backends) == 1:
        return _refused(409, f"{backend.url} is the last decode server; add another first")
    pool.remove(backend)
    ctx.metrics.fleet_changes.labels("remove").inc()
    return JSONResponse({**backend.snapshot(), "removed": True})


async def drain_backend(ctx: ProxyContext, body: dict[str, Any]) -> JSONResponse:
    """No new requests; answer once its in-flight requests have ended or the deadline passed (the report
    says which: `drained`). The backend stays drained (out of rotation) until undrained or removed."""
    pool, backend = _target(ctx, body)
    timeout_s = body.get("timeout_s", DEFAULT_DRAIN_S)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s <= MAX_DRAIN_S:
        return _refused(400, f"'timeout_s' must be a number of seconds in 0..{MAX_DRAIN_S:g}, got {timeout_s!r}")
    pool.set_draining(backend, True)
    ctx.metrics.fleet_changes.labels("drain").inc()
    start = time.monotonic()
    while backend.outstanding > 0 and time.monotonic() - start < timeout_s and backend.draining:
        await asyncio.sleep(DRAIN_POLL_S)
    report = {**backend.snapshot(), "drained": backend.outstanding == 0, "waited_s": round(time.monotonic() - start, 3)}
    logger.info("%s %s drain: %s", pool.role.value, backend.url, report)
    return JSONResponse(report)


async def undrain_backend(ctx: ProxyContext, body: dict[str, Any]) -> JSONResponse:
    pool, backend = _target(ctx, body)
    pool.set_draining(backend, False)
    ctx.metrics.fleet_changes.labels("undrain").inc()
    return JSONResponse(backend.snapshot())


_ACTIONS = {
    ("POST", "/admin/backends"): add_backend,
    ("DELETE", "/admin/backends"): remove_backend,
    ("POST", "/admin/drain"): drain_backend,
    ("POST", "/admin/undrain"): undrain_backend,
}


async def _endpoint(request: Request) -> JSONResponse:
    ctx: ProxyContext = request.app.state.proxy
    refused = _authorized(ctx, request)
    if refused is not None:
        return refused
    action = _ACTIONS[(request.method, request.url.path)]
    try:
        return await action(ctx, await _body(request))
    except ProxyError as exc:
        return _refused(exc.status, exc.message)


def add_routes(app: FastAPI) -> None:
    for method, path in _ACTIONS:
        app.add_api_route(path, _endpoint, methods=[method])
