"""The two dispatch flows for one prompt (params: P then D; transfer-id: P and D at once), with retries."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from . import bodies, hedge
from . import seed as seeding
from .backends import Backend
from .config import Flow, Role
from .context import ProxyContext
from .errors import FailureKind, UpstreamFailure, no_backend
from .prefix import PromptKey
from .seed import FirstToken
from .trace import Mode, Trace
from .upstream import OpenStream, answer_json, cancel_task, open_stream, post_json

logger = logging.getLogger("kv_connectors.proxy")

# vLLM's API server sends a request carrying it to that data-parallel engine.
DP_RANK_HEADER = "X-data-parallel-rank"


@dataclass(frozen=True)
class SubRequest:
    """One prompt of a client request, sent to its own P/D pair."""

    index: int
    body: dict[str, Any]
    headers: dict[str, str]
    key: PromptKey | None = None  # for the prefix policy


@dataclass(frozen=True)
class JsonAnswer:
    """D's whole (non-streamed) answer."""

    content: bytes
    status: int
    media_type: str
    url: str

    def json(self) -> dict[str, Any]:
        try:
            data = json.loads(self.content)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise UpstreamFailure(
                Role.DECODE, self.url, FailureKind.BAD_ANSWER, f"returned a body that is not a JSON object: {self.content[:300]!r}"
            ).to_proxy_error()
        return data


Answer = JsonAnswer | OpenStream


@dataclass(frozen=True)
class Seeded:
    """P answered with a first token that can seed D: the client gets `events` at once, and D's stream
    (`PairRunner.continue_seeded`) continues from prompt + that token."""

    first: FirstToken
    events: bytes
    d_body: dict[str, Any]
    attempt: _Attempt
    p: Backend


async def _discard(task: asyncio.Task[Any]) -> None:
    """Cancel a task nobody will take the result of; close the stream it may already have opened."""
    await cancel_task(task)
    if not task.cancelled() and task.exception() is None and isinstance(answer := task.result(), OpenStream):
        await answer.aclose(False)


class _Budget:
    """Retries left for one prompt; spend() re-raises the failure as the client's error when none is left."""

    def __init__(self, ctx: ProxyContext, trace: Trace) -> None:
        self.ctx, self.trace, self.left = ctx, trace, ctx.config.max_retries

    def spend(self, failure: UpstreamFailure, tried: Collection[Backend], fallback: bool = False) -> None:
        """Count a retry, or raise when none is left, or when no other healthy backend of that role is and
        `fallback` (a decode-only retry after P failed) is not allowed."""
        if self.left <= 0 or not (fallback or self.ctx.pool(failure.role).has_candidate(tried)):
            raise failure.to_proxy_error() from failure
        self.left -= 1
        self.trace.retries += 1
        self.ctx.metrics.retries.labels(failure.role.value).inc()
        logger.info("request %s: retrying after: %s", self.trace.request_id, failure)


@dataclass
class _Attempt:
    """One prompt's way through the fleet: the backends that failed it, each role's last failure, retries."""

    sub: SubRequest
    budget: _Budget
    tried: dict[Role, set[Backend]] = field(default_factory=lambda: {Role.PREFILL: set(), Role.DECODE: set()})
    last: dict[Role, UpstreamFailure] = field(default_factory=dict)


class PairRunner:
    """Runs the prompts of one client request, each on a P/D pair; retries on other backends within budget."""

    def __init__(self, ctx: ProxyContext, route: str, trace: Trace, stream: bool) -> None:
        self.ctx, self.route, self.trace, self.stream = ctx, route, trace, stream
        self._background: list[asyncio.Task[Any]] = []  # P requests still running after D answered

    async def run(self, sub: SubRequest, mode: Mode = Mode.DISAGGREGATED, seed: bool = False) -> Answer | Seeded:
        """D's answer for one prompt: with P's KV (`mode` DISAGGREGATED), or computed by D alone (LOCAL).
        `seed` (a streamed request seed.request_seedable allows, params flow): P's first token, when it can
        seed D, is returned as a Seeded instead, before D is asked."""
        a = _Attempt(sub, _Budget(self.ctx, self.trace))
        if not self.ctx.decode.any_healthy():  # before any work: a prefill no D can use holds P's blocks
            raise no_backend(Role.DECODE)
        if mode is Mode.LOCAL:
            return await self._decode_only(a, Mode.LOCAL)
        if not self.ctx.prefill.any_healthy() and not self._fallback:
            raise no_backend(Role.PREFILL)
        if self.ctx.flow is Flow.TRANSFER_ID:
            while True:
                answer = await self._transfer_pair(a)
                if answer is not None:
                    return answer
        return await self._params(a, seed)

    async def settle(self) -> None:
        """End of the client request: abort P requests still running (their D already has the KV)."""
        tasks, self._background = self._background, []
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                logger.warning("request %s: prefill failed after decode started: %s", self.trace.request_id, task.exception())
            await cancel_task(task)

    # -- shared pieces --

    def _pick(self, role: Role, a: _Attempt) -> Backend:
        backend = self.ctx.pool(role).pick(a.tried[role], a.sub.key)
        if backend is None:
            if role in a.last:
                raise a.last[role].to_proxy_error() from a.last[role]
            raise no_backend(role)
        self.trace.chose(role, backend.url)
        return backend

    def _pick_prefill(self, a: _Attempt) -> Backend | None:
        """A P, or None when there is none left and D may compute the prompt itself (the fallback)."""
        if self._fallback and not self.ctx.prefill.has_candidate(a.tried[Role.PREFILL]):
            return None
        return self._pick(Role.PREFILL, a)

    @property
    def _fallback(self) -> bool:
        return self.ctx.config.decode_only_fallback

    def _failed(self, backend: Backend, failure: UpstreamFailure, a: _Attempt) -> None:
        a.tried[backend.role].add(backend)
        a.last[backend.role] = failure
        self.trace.failed(backend.role, backend.url)
        logger.warning("request %s: %s", self.trace.request_id, failure)
        if failure.marks_unhealthy:
            self.ctx.pool(backend.role).mark_failed(backend, str(failure))

    async def _post_prefill(
        self, sub: SubRequest, p: Backend, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        resp = await post_json(
            self.ctx.http(), self.ctx.prefill.begin(p), self.route, body, headers or sub.headers, self.ctx.config.prefill_timeout_s
        )
        self.trace.prefill_answered()
        return answer_json(Role.PREFILL, p.url, resp)

    async def _decode(self, sub: SubRequest, d: Backend, body: dict[str, Any]) -> Answer:
        call = self.ctx.decode.begin(d)
        timeout_s = self.ctx.config.decode_timeout_s
        if self.stream:
            opened = await open_stream(self.ctx.http(), call, self.route, body, sub.headers, timeout_s)
            self.trace.decode_first_byte(streaming=True)
            return opened
        resp = await post_json(self.ctx.http(), call, self.route, body, sub.headers, timeout_s)
        self.trace.decode_first_byte(streaming=False)
        return JsonAnswer(resp.content, resp.status_code, resp.headers.get("content-type", "application/json"), d.url)

    def _decode_failed(self, d: Backend, failure: UpstreamFailure, a: _Attempt, p: Backend | None = None) -> None:
        """A D failure before any byte reached the client: spend a retry (a slow D is not retried).

        D answered with an error (HTTP 5xx, or an error event before its first token: vLLM's answer to a
        failed KV load): the KV it was handed is as likely the cause as D itself, so P is not used again
        for this prompt, and D is, when no other D is left."""
        self._failed(d, failure, a)
        if failure.kind is FailureKind.TIMEOUT:
            raise failure.to_proxy_error() from failure
        if failure.kind in (FailureKind.SERVER_ERROR, FailureKind.STREAM_ERROR):
            if p is not None:
                a.tried[Role.PREFILL].add(p)
            if not self.ctx.decode.has_candidate(a.tried[Role.DECODE]):
                a.tried[Role.DECODE].discard(d)
        a.budget.spend(failure, a.tried[failure.role])

    def _prefill_failed(self, p: Backend, failure: UpstreamFailure, a: _Attempt) -> None:
        self._failed(p, failure, a)
        a.budget.spend(failure, a.tried[failure.role], fallback=self._fallback)

    # -- D alone: a short prompt (LOCAL), or no P left (FALLBACK) --

    def _alone(self, mode: Mode, why: str) -> None:
        """From here D computes the prompt itself (`why`, logged for a fallback): counted and traced."""
        self.trace.mode = mode
        self.ctx.metrics.decode_only.labels(mode.value).inc()
        if mode is Mode.FALLBACK:
            logger.warning("request %s: %s; decode computes the prompt", self.trace.request_id, why)

    async def _decode_only(self, a: _Attempt, mode: Mode) -> Answer:
        self._alone(mode, "no prefill server left")
        d_body = bodies.decode_only_body(a.sub.body)
        while True:
            d = self._pick(Role.DECODE, a)
            try:
                return await self._decode(a.sub, d, d_body)
            except UpstreamFailure as failure:
                self._decode_failed(d, failure, a)

    # -- params flow (NIXL): P answers with kv_transfer_params, D gets them --

    async def _params(self, a: _Attempt, seed: bool = False) -> Answer | Seeded:
        while True:
            p = self._pick_prefill(a)
            if p is None:
                return await self._decode_only(a, Mode.FALLBACK)
            try:
                p, (kv_params, token_ids, answer) = await self._prefill_raced(a, p, seed)
            except UpstreamFailure as failure:  # each P it went to failed (recorded): retry within budget
                a.budget.spend(failure, a.tried[Role.PREFILL], fallback=self._fallback)
                continue
            if seed:
                first, result = seeding.decide(self.route, answer, kv_params)
                self.ctx.metrics.first_token.labels(result).inc()
                if first is not None:
                    self.trace.seeded = True
                    d_body = seeding.continue_body(self.route, a.sub.body, kv_params, first)
                    return Seeded(first, seeding.first_events(self.route, a.sub.body, first), d_body, a, p)
            d_body = bodies.decode_body_params(self.route, a.sub.body, kv_params, token_ids)
            while True:
                d = self._pick(Role.DECODE, a)
                try:
                    return await self._decode(a.sub, d, d_body)
                except UpstreamFailure as failure:
                    self._decode_failed(d, failure, a, p)
                    if failure.kind is not FailureKind.NOT_REACHED:
                        break  # D may have read (and released) P's blocks: prefill again
                    # never reached D: P still holds the blocks under its lease, same params on another D

    async def _prefill_raced(
        self, a: _Attempt, p: Backend, seed: bool
    ) -> tuple[Backend, tuple[dict[str, Any] | None, list[int] | None, dict[str, Any]]]:
        """The P that answered and its answer: P's, or a second P's when P is still silent after the hedge
        delay and that one answers first (hedge.race). A P evicted meanwhile (its health checks, or another
        request's failure to reach it: a frozen or hung P keeps its connections open and never answers)
        is left when the prompt can go elsewhere, instead of waiting out its timeout."""

        def hedge_to() -> Backend | None:
            second = self.ctx.prefill.pick(a.tried[Role.PREFILL] | {p}, a.sub.key, advance=False)
            if second is not None:
                self.trace.chose(Role.PREFILL, second.url)
            return second

        won = await hedge.race(
            p,
            lambda b: self._prefill_params(a.sub, b, seed),
            self.ctx.hedge,
            hedge_to,
            lambda b: self._may_leave(a, b),
            lambda b, failure: self._failed(b, failure, a),
        )
        if won.hedged:
            self.trace.hedge = "won" if won.by_hedge else "lost"
            self.ctx.metrics.hedges.labels(self.trace.hedge).inc()
        return won.backend, won.answer

    def _may_leave(self, a: _Attempt, p: Backend) -> bool:
        """Whether a prompt waiting on P could retry elsewhere: a retry left and another P, or D alone."""
        return a.budget.left > 0 and (self._fallback or self.ctx.prefill.has_candidate(a.tried[Role.PREFILL] | {p}))

    async def _prefill_params(
        self, sub: SubRequest, p: Backend, seed: bool = False
    ) -> tuple[dict[str, Any] | None, list[int] | None, dict[str, Any]]:
        """P's kv_transfer_params, the prompt token ids for D (when D is to get ids), P's whole answer."""
        forward_ids = bodies.wants_token_forwarding(self.route, sub.body)
        body = bodies.prefill_body(sub.body, dict(bodies.PREFILL_KV_PARAMS), return_token_ids=forward_ids or seed)
        answer = await self._post_prefill(sub, p, body)
        kv_params = answer.get("kv_transfer_params")
        if not isinstance(kv_params, dict):
            logger.warning(
                "request %s: prefill %s answered without kv_transfer_params; decode recomputes the prompt",
                self.trace.request_id,
                p.url,
            )
            kv_params = None
        token_ids = bodies.prompt_token_ids(self.route, answer) if forward_ids else None
        return kv_params, token_ids, answer

    async def continue_seeded(self, s: Seeded) -> OpenStream:
        """D's stream after the first token: with P's KV; after a failure that may have cost P's KV, D
        computes prompt + first token itself (the client already has the first token: no new prefill)."""
        a, body = s.attempt, s.d_body
        while True:
            d = self._pick(Role.DECODE, a)
            try:
                answer = await self._decode(a.sub, d, body)
            except UpstreamFailure as failure:
                self._decode_failed(d, failure, a, s.p)
                if failure.kind is not FailureKind.NOT_REACHED and "kv_transfer_params" in body:
                    body = seeding.continue_body(self.route, a.sub.body, None, s.first)
                    self._alone(Mode.FALLBACK, "P's KV may be lost after its first token went out")
                continue
            assert isinstance(answer, OpenStream)  # seeding is for streamed requests
            return answer

    # -- transfer-id flow (Mooncake push): P and D addressed together --

    async def _prefill_tid(self, sub: SubRequest, p: Backend, transfer_id: str, dp_rank: int | None) -> None:
        """P's request; dp_rank: to that data-parallel engine of P (vLLM's X-data-parallel-rank), whose
        side channel D is told."""
        body = bodies.prefill_body(sub.body, bodies.transfer_prefill_params(transfer_id), return_token_ids=False)
        headers = None if dp_rank is None else {**sub.headers, DP_RANK_HEADER: str(dp_rank)}
        await self._post_prefill(sub, p, body, headers)

    async def _transfer_pair(self, a: _Attempt) -> Answer | None:
        """One P with a fresh transfer id, and D (another D only if D was never reached); None: new pair."""
        p = self._pick_prefill(a)
        if p is None:
            return await self._decode_only(a, Mode.FALLBACK)
        d = self._pick(Role.DECODE, a)
        assert p.side_channel is not None  # ProxyConfig guarantees it for this flow
        transfer_id = "kvc-" + uuid.uuid4().hex
        side_channel, dp_rank = p.side_channel, None
        if side_channel.dp_size > 1:  # one side channel per engine: pin P's request to the one D is told
            dp_rank = p.next_dp_rank()
            side_channel = side_channel.engine(dp_rank)
        p_task = asyncio.create_task(self._prefill_tid(a.sub, p, transfer_id, dp_rank))
        handed_over = False
        try:
            while True:
                d_body = bodies.transfer_decode_body(a.sub.body, transfer_id, side_channel)
                d_task = asyncio.create_task(self._decode(a.sub, d, d_body))
                try:
                    await _until_decoded_or_prefill_failed(d_task, p_task)
                except BaseException:  # cancelled (the client left, a sibling prompt failed): D too
                    await _discard(d_task)
                    raise
                if not d_task.done():  # P failed first: abort D
                    await cancel_task(d_task)
                if not d_task.cancelled() and d_task.exception() is None:
                    handed_over = True
                    self._background.append(p_task)
                    return d_task.result()
                if p_task.done() and (p_task.cancelled() or p_task.exception() is not None):
                    self._prefill_task_failed(p, p_task, a)
                    return None
                failure = d_task.exception()
                if not isinstance(failure, UpstreamFailure):
                    raise failure or RuntimeError("decode task ended without an answer")
                self._decode_failed(d, failure, a, p)
                if failure.kind is not FailureKind.NOT_REACHED:
                    return None
                d = self._pick(Role.DECODE, a)  # same P and transfer id: P waits for a D
        finally:
            if not handed_over:
                await cancel_task(p_task)

    def _prefill_task_failed(self, p: Backend, p_task: asyncio.Task[None], a: _Attempt) -> None:
        if p_task.cancelled():
            raise asyncio.CancelledError
        failure = p_task.exception()
        if not isinstance(failure, UpstreamFailure):
            raise failure  # type: ignore[misc]  # P's own 4xx (ProxyError) goes to the client
        self._prefill_failed(p, failure, a)


async def _until_decoded_or_prefill_failed(d_task: asyncio.Task[Any], p_task: asyncio.Task[Any]) -> None:
    """Wait until D has answered (or failed), or P failed before that."""
    while not d_task.done():
        if p_task.done() and (p_task.cancelled() or p_task.exception() is not None):
            return
        await asyncio.wait({d_task} if p_task.done() else {d_task, p_task}, return_when=asyncio.FIRST_COMPLETED)
