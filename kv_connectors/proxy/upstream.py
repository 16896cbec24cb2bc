"""One HTTP call to one backend: P's JSON answer, D's JSON answer, or D's stream opened up to its first byte."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from .backends import BackendCall
from .config import Role
from .errors import EXCERPT_CHARS, FailureKind, Outcome, ProxyError, UpstreamFailure
from .sse import EventKind, FirstOutput, error_message

CONNECT_TIMEOUT_S = 5.0
logger = logging.getLogger("kv_connectors.proxy")
TRACEBACK_EVERY_S = 60.0  # a foreign error's traceback, once a minute per backend and type (a dying one raises it per request)
_tracebacks: dict[str, float] = {}


async def cancel_task(task: asyncio.Future[Any]) -> None:
    """Cancel and wait for `task` (a call in flight: its backend sees the connection close); its own
    failure is consumed (logged at debug level)."""
    if not task.done():
        task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is not None:
        logger.debug("background task ended with %r", task.exception())


def timeout(total_s: float) -> httpx.Timeout:
    return httpx.Timeout(total_s, connect=min(CONNECT_TIMEOUT_S, total_s))


def classify(role: Role, url: str, exc: Exception) -> UpstreamFailure:
    """What an exception out of an HTTP call to a backend means for the flows.

    httpx's own errors say it (refused, timed out, dropped); anything else that leaves the call came
    from below httpx (httpcore's, anyio's or the OS's errors, which httpx lets through where it closes
    a response: encode/httpx#1463) while the backend's connection failed: a dropped connection, never
    the proxy's internal error."""
    name = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UpstreamFailure(role, url, FailureKind.NOT_REACHED, f"unreachable ({name})")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamFailure(role, url, FailureKind.TIMEOUT, f"timed out ({name})")
    if not isinstance(exc, httpx.HTTPError):
        _traceback(f"{role.value} {url} {type(exc).__name__}", exc)
        name = f"{type(exc).__module__}.{name}"
    return UpstreamFailure(role, url, FailureKind.DISCONNECTED, f"failed ({name})")


def _traceback(key: str, exc: Exception) -> None:
    """Log where a foreign error came from, at most once per TRACEBACK_EVERY_S for `key` (the failure itself
    is logged per request by the flows)."""
    now = time.monotonic()
    if now - _tracebacks.get(key, float("-inf")) < TRACEBACK_EVERY_S:
        return
    if len(_tracebacks) >= 1024:
        _tracebacks.clear()
    _tracebacks[key] = now
    logger.warning("%s: the HTTP client raised %s from below httpx", key, type(exc).__name__, exc_info=exc)


async def close_response(resp: httpx.Response) -> None:
    """Close a backend's response (its connection, when unread: the backend aborts the request), whatever
    the dying connection raises while closing (httpx lets httpcore's errors through there: encode/httpx#1463)."""
    with anyio.CancelScope(shield=True):
        try:
            await resp.aclose()
        except Exception as exc:  # noqa: BLE001 - closing a failed connection: nothing left to do
            logger.debug("closing a response from %s raised %r", resp.request.url, exc)


def check_status(role: Role, url: str, resp: httpx.Response) -> None:
    """Return if 2xx. A 4xx JSON body passes through to the client; 5xx is a failure worth a retry."""
    if resp.is_success:
        return
    status = resp.status_code
    if 400 <= status < 500:
        with contextlib.suppress(ValueError):
            resp.json()
            raise ProxyError(status, resp.text, "backend_error", Outcome.BACKEND_REJECTED, raw=resp.content)
        msg = f"{role.value} server {url} returned HTTP {status}: {resp.text[:EXCERPT_CHARS]}"
        raise ProxyError(status, msg, "upstream_error", Outcome.BACKEND_REJECTED)
    raise UpstreamFailure(role, url, FailureKind.SERVER_ERROR, f"returned HTTP {status}: {resp.text[:EXCERPT_CHARS]}")


async def post_json(
    client: httpx.AsyncClient, call: BackendCall, path: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float
) -> httpx.Response:
    """POST and read the whole answer; raises UpstreamFailure or ProxyError; ends `call`."""
    role, url = call.pool.role, call.backend.url
    answered: bool | None = False  # a 2xx or 4xx answer: the backend did its job; None: we cancelled the call
    try:
        try:
            with anyio.fail_after(timeout_s):  # the whole answer, whatever the transport's own timeouts do
                resp = await client.post(url + path, json=body, headers=headers, timeout=timeout(timeout_s))
        except TimeoutError as exc:
            raise _deadline(role, url, timeout_s) from exc
        except Exception as exc:  # only the HTTP client runs in here
            raise classify(role, url, exc) from exc
        except asyncio.CancelledError:  # a hedge that lost, a client that left: not the backend's failure
            answered = None
            raise
        answered = resp.status_code < 500
        check_status(role, url, resp)
        return resp
    finally:
        call.end(answered)


def answer_json(role: Role, url: str, resp: httpx.Response) -> dict[str, Any]:
    try:
        data = resp.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise UpstreamFailure(
            role, url, FailureKind.BAD_ANSWER, f"returned a body that is not a JSON object: {resp.text[:EXCERPT_CHARS]}"
        )
    return data


@dataclass(eq=False)
class OpenStream:
    """D's streaming answer whose first bytes have arrived; the rest is read by whoever relays it."""

    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes
    call: BackendCall

    async def rest(self) -> AsyncIterator[bytes]:
        """The stream from its first bytes; a failure reading it is an UpstreamFailure (classify)."""
        yield self.first
        while True:
            try:
                chunk = await self.chunks.__anext__()
            except StopAsyncIteration:
                return
            except Exception as exc:  # only the HTTP client runs in here
                raise classify(self.call.pool.role, self.call.backend.url, exc) from exc
            yield chunk

    async def aclose(self, ok: bool) -> None:
        """Close the upstream (which aborts the request at D if it is still running)."""
        await close_response(self.response)
        self.call.end(ok)


async def open_stream(
    client: httpx.AsyncClient, call: BackendCall, path: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float
) -> OpenStream:
    """POST with a streamed answer and wait for its first output (see _until_first_output)."""
    role, url = call.pool.role, call.backend.url
    request = client.build_request("POST", url + path, json=body, headers=headers, timeout=timeout(timeout_s))
    resp: httpx.Response | None = None
    try:
        with anyio.fail_after(timeout_s):  # up to the first byte
            resp = await client.send(request, stream=True)
            if not resp.is_success:
                await resp.aread()
                check_status(role, url, resp)
            chunks = resp.aiter_bytes()
            first = await _until_first_output(role, url, resp, chunks)
    except BaseException as exc:
        if resp is not None:
            await close_response(resp)
        call.end(isinstance(exc, ProxyError))
        if isinstance(exc, TimeoutError):
            raise _deadline(role, url, timeout_s) from exc
        if isinstance(exc, StopAsyncIteration):
            raise UpstreamFailure(role, url, FailureKind.BAD_ANSWER, "closed its stream without data") from None
        if isinstance(exc, (ProxyError, UpstreamFailure)) or not isinstance(exc, Exception):
            raise  # the answer judged (check_status, the first event), or a cancellation
        raise classify(role, url, exc) from exc
    return OpenStream(resp, chunks, first, call)


async def _until_first_output(role: Role, url: str, resp: httpx.Response, chunks: AsyncIterator[bytes]) -> bytes:
    """The stream's bytes up to its first output event (a token, a finish); an error event before it (vLLM's
    answer to a failed KV load, after its 200) is an UpstreamFailure the flows may retry, never the client's.
    A stream that is not SSE: its first bytes."""
    if "text/event-stream" not in resp.headers.get("content-type", ""):
        first = b""
        while not first:
            first = await chunks.__anext__()
        return first
    hold = FirstOutput()
    while True:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            if hold.held.strip():
                return hold.held  # ended without output (a D that sent only preamble): relayed as it is
            raise
        seen = hold.feed(chunk)
        if seen is None:
            continue
        kind, event = seen
        if kind is EventKind.ERROR:
            raise UpstreamFailure(
                role, url, FailureKind.STREAM_ERROR, f"sent an error before its first token: {error_message(event)}"
            )
        return hold.held


def _deadline(role: Role, url: str, timeout_s: float) -> UpstreamFailure:
    return UpstreamFailure(role, url, FailureKind.TIMEOUT, f"timed out (no answer within {timeout_s:g} s)")
