"""Streams D's SSE answer(s) to the client; one sub-stream as is, several merged into one with re-indexed choices."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

import anyio
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from .bodies import SseReindexer, merged_usage_event
from .config import Role
from .context import ProxyContext
from .errors import FailureKind, Outcome, ProxyError, UpstreamFailure, sse_error
from .seed import ContinuationRewriter
from .sse import DoneSeen
from .trace import Trace
from .upstream import OpenStream

DONE_EVENT = b"data: [DONE]\n\n"


class RelayResponse(StreamingResponse):
    """SSE relay of opened D streams; when it ends, for whatever reason, every upstream is closed (aborting D),
    P requests still running are settled, and the request's log line is written."""

    def __init__(
        self, ctx: ProxyContext, streams: Sequence[OpenStream], trace: Trace, settle: Callable[[], Awaitable[None]]
    ) -> None:
        self._ctx, self._streams, self._trace, self._settle = ctx, list(streams), trace, settle
        self._body = self._relay_one() if len(self._streams) == 1 else self._relay_merged()
        media_type = self._streams[0].response.headers.get("content-type", "text/event-stream")
        super().__init__(self._body, status_code=200, media_type=media_type, headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):  # ASGI spec >= 2.4 servers: an expected end, not an app error
            pass
        finally:
            with anyio.CancelScope(shield=True):
                await self._body.aclose()
                ok = self._trace.outcome is Outcome.OK
                for stream in self._streams:
                    await stream.aclose(ok)
                await self._settle()
            self._trace.finish(self.status_code)

    def _mid_stream_failure(self, stream: OpenStream, failure: UpstreamFailure) -> bytes:
        self._trace.outcome = Outcome.FAILED_MID_STREAM
        self._trace.failed(Role.DECODE, stream.call.backend.url)
        if failure.marks_unhealthy:
            self._ctx.decode.mark_failed(stream.call.backend, str(failure))
        status = 504 if failure.kind is FailureKind.TIMEOUT else 502
        return sse_error(status, f"{failure} mid-stream", "upstream_timeout" if status == 504 else "upstream_error")

    async def _relay_one(self) -> AsyncGenerator[bytes, None]:
        self._trace.outcome = Outcome.CLIENT_DISCONNECTED  # unless the stream ends by itself or [DONE] went out
        async for out in self._relay_stream(self._streams[0]):
            yield out

    async def _relay_stream(self, stream: OpenStream, rewriter: ContinuationRewriter | None = None) -> AsyncGenerator[bytes, None]:
        """One D stream to the client (through `rewriter` when given); the outcome OK once it ended or [DONE]
        went out, a mid-stream failure as an SSE error event."""
        done = DoneSeen()
        try:
            async for chunk in stream.rest():
                out = chunk if rewriter is None else rewriter.feed(chunk)
                if out:
                    yield out
                    done.feed(out)
                    if done.seen:  # the client has the whole answer: closing now is not a disconnect
                        self._trace.outcome = Outcome.OK
            tail = b"" if rewriter is None else rewriter.flush()
            if tail:
                yield tail
        except UpstreamFailure as failure:
            yield self._mid_stream_failure(stream, failure)
        else:
            self._trace.outcome = Outcome.OK

    async def _relay_merged(self) -> AsyncGenerator[bytes, None]:
        """Sub-streams relayed as their events come, choice index = prompt index; one usage chunk, one [DONE]."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        reindexers = [SseReindexer(i) for i in range(len(self._streams))]
        failures: list[bytes] = []

        async def pump(stream: OpenStream, reindexer: SseReindexer) -> None:
            try:
                async for chunk in stream.rest():
                    for event in reindexer.feed(chunk):
                        await queue.put(event)
                for event in reindexer.flush():
                    await queue.put(event)
            except UpstreamFailure as failure:
                failures.append(self._mid_stream_failure(stream, failure))
            finally:
                await queue.put(None)

        self._trace.outcome = Outcome.CLIENT_DISCONNECTED
        tasks = [asyncio.create_task(pump(s, r)) for s, r in zip(self._streams, reindexers)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                    if failures:
                        yield failures[0]
                        return
                else:
                    yield item
            self._trace.outcome = Outcome.OK  # set before the last yield: a client leaving after [DONE] completed
            yield merged_usage_event(reindexers) + DONE_EVENT
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class SeededRelayResponse(RelayResponse):
    """First token from prefill: the client gets P's first token at once (`first_events`), then D's
    continuation, opened (with its retries) by `open_rest` and rewritten by `rewriter`; cleanup as in
    RelayResponse."""

    def __init__(
        self,
        ctx: ProxyContext,
        trace: Trace,
        settle: Callable[[], Awaitable[None]],
        first_events: bytes,
        open_rest: Callable[[], Awaitable[OpenStream]],
        rewriter: ContinuationRewriter,
    ) -> None:
        self._ctx, self._streams, self._trace, self._settle = ctx, [], trace, settle
        self._first_events, self._open_rest, self._rewriter = first_events, open_rest, rewriter
        self._body = self._relay_seeded()
        StreamingResponse.__init__(
            self, self._body, status_code=200, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def _relay_seeded(self) -> AsyncGenerator[bytes, None]:
        self._trace.outcome = Outcome.CLIENT_DISCONNECTED  # unless the loop ends by itself or [DONE] went out
        self._trace.decode_first_byte(streaming=True)  # the client's first token: P's
        yield self._first_events
        try:
            stream = await self._open_rest()
        except ProxyError as exc:
            self._trace.outcome = exc.outcome
            yield sse_error(exc.status, f"{exc.message} (after the first token)", exc.err_type)
            return
        self._streams.append(stream)
        async for out in self._relay_stream(stream, self._rewriter):
            yield out
