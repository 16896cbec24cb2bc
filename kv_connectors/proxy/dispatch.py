"""One client completion request: split into prompts, each run on a P/D pair, answers merged into one response."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, Response

from . import bodies, tokens
from . import seed as seeding
from .config import Flow, Policy
from .context import ProxyContext
from .flows import Answer, JsonAnswer, PairRunner, Seeded, SubRequest
from .prefix import prompt_key
from .relay import RelayResponse, SeededRelayResponse
from .seed import ContinuationRewriter
from .trace import Mode, Trace
from .upstream import OpenStream, cancel_task

REQUEST_ID_HEADER = "X-Request-Id"
T = TypeVar("T")


async def _close_answers(answers: Sequence[Any]) -> None:
    for answer in answers:
        if isinstance(answer, OpenStream):
            await answer.aclose(False)


async def gather_or_cancel(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run all; on the first failure (or if we are cancelled) cancel the rest, close opened streams, re-raise."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    except BaseException:
        for task in tasks:
            await cancel_task(task)
        await _close_answers([t.result() for t in tasks if not t.cancelled() and t.exception() is None])
        raise


def sub_requests(route: str, body: dict[str, Any], headers: dict[str, str]) -> list[SubRequest]:
    """One per prompt; split prompts get the request id suffixed with their index."""
    parts = bodies.split_prompts(route, body)
    if len(parts) == 1:
        return [SubRequest(0, parts[0], headers)]
    rid = headers[REQUEST_ID_HEADER]
    return [SubRequest(i, part, {**headers, REQUEST_ID_HEADER: f"{rid}-{i}"}) for i, part in enumerate(parts)]


async def _run(ctx: ProxyContext, route: str, runner: PairRunner, sub: SubRequest, seed: bool = False) -> Answer | Seeded:
    """One prompt: D alone when what the D the policy picks has not cached of it (all of it, without the
    prefix policy on D) is shorter than --local-prefill-below, else P and D (`seed`: first token from prefill, if P's allows)."""
    limit = ctx.config.local_prefill_below
    cached = ctx.decode.expected_match(sub.key) if sub.key is not None else 0.0
    count = sub.key.units if sub.key is not None and not sub.key.text else None  # ids known: no second /tokenize
    local = limit > 0 and await tokens.uncached_below(ctx, route, sub.body, limit, cached, count)
    return await runner.run(sub, Mode.LOCAL if local else Mode.DISAGGREGATED, seed=seed and not local)


def _seed(ctx: ProxyContext, route: str, body: dict[str, Any], subs: list[SubRequest]) -> bool:
    """Whether to try first token from prefill: on, one streamed prompt, params flow, options that allow it."""
    return (
        ctx.config.first_token_from_prefill and len(subs) == 1 and ctx.flow is Flow.PARAMS and seeding.request_seedable(route, body)
    )


async def _with_keys(ctx: ProxyContext, route: str, subs: list[SubRequest]) -> list[SubRequest]:
    """Each prompt's prefix key, when a pool routes by prefix: by its token ids where a pool learns from
    KV events (text and chat tokenized by a D), else as the prompt comes."""
    cfg = ctx.config
    if Policy.PREFIX not in (cfg.prefill_policy, cfg.decode_policy):
        return subs
    chunk = cfg.prefix.chunk_tokens
    keys = [bodies.prefix_key(route, s.body, chunk) for s in subs]
    if ctx.learns_from_events():
        for i, s in enumerate(subs):
            if keys[i].text and (ids := await tokens.token_ids(ctx, route, s.body)) is not None:
                keys[i] = prompt_key(ids, None, chunk)
    return [replace(s, key=key) for s, key in zip(subs, keys)]


async def dispatch(ctx: ProxyContext, route: str, body: dict[str, Any], headers: dict[str, str], trace: Trace) -> Response:
    """The client's response: D's answer as is (one prompt), merged answers (several), or a relayed stream."""
    runner = PairRunner(ctx, route, trace, bodies.is_stream(body))
    subs = await _with_keys(ctx, route, sub_requests(route, body, headers))
    seed = _seed(ctx, route, body, subs)
    try:
        answers: list[Answer | Seeded] = await gather_or_cancel([_run(ctx, route, runner, s, seed) for s in subs])
    except BaseException:
        await runner.settle()
        raise
    if isinstance(answers[0], Seeded):
        seeded = answers[0]
        return SeededRelayResponse(
            ctx, trace, runner.settle, seeded.events, lambda: runner.continue_seeded(seeded), ContinuationRewriter(seeded.first)
        )
    if runner.stream:
        streams = [a for a in answers if isinstance(a, OpenStream)]
        return RelayResponse(ctx, streams, trace, runner.settle)
    await runner.settle()
    json_answers = [a for a in answers if isinstance(a, JsonAnswer)]
    if len(json_answers) == 1:
        only = json_answers[0]
        return Response(only.content, status_code=only.status, media_type=only.media_type)
    return JSONResponse(bodies.merge_answers([a.json() for a in json_answers]))
