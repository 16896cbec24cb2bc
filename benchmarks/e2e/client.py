"""bench_e2e's load: streamed greedy completions at a concurrency level, timing the first token and the end,
and its verdict (`evaluate`: figures only where every output matched the reference). The GPU check
(benchmarks/gpu/steps.py) measures TTFT with the same load and verdict."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from benchmarks.e2e.stats import Sample, summarize


class RequestFailed(Exception):
    """A benchmark request got an error status, an error chunk, no token, or ran past its deadline."""


def request_body(prompt: Sequence[int], max_tokens: int) -> dict[str, object]:
    """Greedy, streamed, exactly max_tokens tokens (ignore_eos), token ids in every chunk."""
    return {
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    prompt: Sequence[int],
    max_tokens: int,
    extra_body: Mapping[str, object] | None = None,
    t0: float | None = None,
) -> Sample:
    """POST one streamed completion; TTFT = time to the first SSE chunk carrying a token, counted
    from t0 (default: now). extra_body adds fields, e.g. kv_transfer_params."""
    t0 = time.perf_counter() if t0 is None else t0
    first: float | None = None
    first_tokens = 0
    ids: list[int] = []
    async with client.stream("POST", f"{url}/v1/completions", json={**request_body(prompt, max_tokens), **(extra_body or {})}) as r:
        if r.status_code != 200:
            body = (await r.aread()).decode("utf-8", errors="replace")
            raise RequestFailed(f"HTTP {r.status_code}: {body[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data.strip() == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RequestFailed(f"error chunk: {str(chunk['error'])[:300]}")
            for choice in chunk.get("choices") or ():
                tokens = choice.get("token_ids") or ()
                if tokens and first is None:
                    first = time.perf_counter()
                    first_tokens = len(tokens)
                ids.extend(tokens)
                if choice.get("finish_reason") == "error":
                    raise RequestFailed("finish_reason error")
    end = time.perf_counter()
    if first is None:
        raise RequestFailed("the stream carried no token")
    return Sample(len(prompt), first - t0, end - t0, tuple(ids), first_tokens)


async def _run(
    url: str, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int, timeout_s: float
) -> tuple[list[Sample | RequestFailed], float]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def guarded(prompt: Sequence[int]) -> Sample | RequestFailed:
            async with gate:
                try:
                    return await asyncio.wait_for(stream_one(client, url, prompt, max_tokens), timeout_s)
                except asyncio.TimeoutError:
                    return RequestFailed(f"no complete answer within {timeout_s:g} s")
                except (RequestFailed, httpx.HTTPError, ValueError) as e:
                    return e if isinstance(e, RequestFailed) else RequestFailed(f"{type(e).__name__}: {e}")

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        return list(results), time.perf_counter() - t0


def run_load(
    url: str, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int, timeout_s: float = 300.0
) -> tuple[list[Sample | RequestFailed], float]:
    """Every prompt once, at most `concurrency` in flight, in order of submission; (results in prompt order, wall s)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    return asyncio.run(_run(url, prompts, max_tokens, concurrency, timeout_s))


def evaluate(
    results: Sequence[Sample | RequestFailed], wall_s: float, reference: Sequence[tuple[int, ...]] | None, lengths: Sequence[int]
) -> tuple[dict[str, Any] | None, str | None, dict[str, Any]]:
    """(figures, error, details): figures only if every request answered and matched the reference."""
    failures = [(lengths[i], str(r)) for i, r in enumerate(results) if isinstance(r, RequestFailed)]
    samples = [r for r in results if isinstance(r, Sample)]
    mismatches = [
        lengths[i]
        for i, r in enumerate(results)
        if isinstance(r, Sample) and reference is not None and r.output_ids != reference[i]
    ]
    details = {
        "requests": len(results),
        "failed_requests": len(failures),
        "mismatches": len(mismatches),
        "mismatch_lengths": mismatches,
    }
    if failures:
        return None, f"{len(failures)} of {len(results)} requests failed, first (length, error): {failures[0]}", details
    if mismatches:
        error = f"{len(mismatches)} of {len(results)} outputs differ from colocated (lengths {mismatches})"
        return None, error, details
    return summarize(samples, wall_s), None, details
