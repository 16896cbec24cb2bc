"""Client traffic for a fleet behind a proxy: mixed OpenAI requests (completions by token ids or text,
chat; streamed or not), their answers reduced to what a colocated server must repeat token for token,
and the proxy's /health and /metrics read back. Used by the proxy's end-to-end tests and the load
benchmark (benchmarks/faults/bench_load.py)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvc_testing.cluster import make_prompts

MAX_TOKENS = 8
CONCURRENCY = 8
WORDS = (
    "the garden paper river stone light window morning music table quiet green letter city road winter bread friend story north"
).split()


class HasUrl(Protocol):
    @property
    def url(self) -> str: ...


@dataclass(frozen=True)
class Case:
    kind: str  # "cmpl_ids" | "cmpl_text" | "chat"
    prompt: Any
    stream: bool
    max_tokens: int = MAX_TOKENS

    def body(self) -> tuple[str, dict[str, Any]]:
        base: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": 0, "stream": self.stream}
        if self.stream:
            base["stream_options"] = {"include_usage": True}
        if self.kind == "chat":
            return "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": self.prompt}]}
        return "/v1/completions", {**base, "prompt": self.prompt, "return_token_ids": True}


@dataclass(frozen=True)
class Outcome:
    ok: bool
    # completions: (prompt token ids, output token ids, text, finish reason, usage); chat: (text, finish
    # reason, usage); usage = (prompt tokens, completion tokens)
    output: Any = None
    error: str = ""
    seconds: float = 0.0  # from sending to the last byte


def _usage(usage: Any) -> tuple[int, int] | None:
    return None if not isinstance(usage, dict) else (usage["prompt_tokens"], usage["completion_tokens"])


def make_cases(n: int, seed: int, max_tokens: int = MAX_TOKENS) -> list[Case]:
    """n requests, a third of each kind, half of them streamed; prompts of 2-300 tokens or 3-120 words."""
    rng = random.Random(seed)
    id_prompts = make_prompts([rng.randrange(2, 300) for _ in range(n)], seed=seed)
    cases = []
    for i in range(n):
        kind = ("cmpl_ids", "cmpl_text", "chat")[i % 3]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 120)))
        cases.append(Case(kind, id_prompts[i] if kind == "cmpl_ids" else text, (i // 3) % 2 == 0, max_tokens))
    return cases


def _events(resp: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _ask(client: httpx.Client, url: str, case: Case) -> Outcome:
    path, body = case.body()
    if not case.stream:
        resp = client.post(url + path, json=body)
        if resp.status_code != 200:
            return Outcome(False, error=f"{resp.status_code}: {resp.json()['error']['message']}")
        answer = resp.json()
        choice, usage = answer["choices"][0], _usage(answer.get("usage"))
        if case.kind == "chat":
            return Outcome(True, (choice["message"]["content"], choice["finish_reason"], usage))
        return Outcome(True, (choice["prompt_token_ids"], choice["token_ids"], choice["text"], choice["finish_reason"], usage))
    prompt_ids: list[int] = []
    out_ids: list[int] = []
    text = ""
    finish = None
    usage = None
    with client.stream("POST", url + path, json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            return Outcome(False, error=f"{resp.status_code}: {resp.json()['error']['message']}")
        for event in _events(resp):
            if "error" in event:
                return Outcome(False, error=f"stream: {event['error']['message']}")
            usage = _usage(event.get("usage")) or usage
            for choice in event["choices"]:
                prompt_ids += choice.get("prompt_token_ids") or []
                out_ids += choice.get("token_ids") or []
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
    if case.kind == "chat":
        return Outcome(True, (text, finish, usage))
    return Outcome(True, (prompt_ids, out_ids, text, finish, usage))


def run_case(url: str, case: Case, timeout: float = 120.0) -> Outcome:
    """One request; a clear error (HTTP error JSON or SSE error event) is an Outcome, anything else
    (no answer within `timeout`, a connection cut without an error) raises."""
    t0 = time.monotonic()
    with httpx.Client(timeout=timeout) as client:
        outcome = _ask(client, url, case)
    return Outcome(outcome.ok, outcome.output, outcome.error, time.monotonic() - t0)


def run_all(
    url: str,
    cases: list[Case],
    on_done: Callable[[], None] | None = None,
    concurrency: int = CONCURRENCY,
    timeout: float = 120.0,
) -> list[Outcome]:
    """Every case, `concurrency` in flight; on_done after each (from the client threads)."""

    def one(case: Case) -> Outcome:
        outcome = run_case(url, case, timeout)
        if on_done is not None:
            on_done()
        return outcome

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, cases))


class Countdown:
    """Starts each action in a thread of its own once `done()` has been called its count of times
    (from the client threads); join() waits for them all."""

    def __init__(self, actions: dict[int, Callable[[], None]]) -> None:
        self._actions = dict(actions)
        self._count = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def done(self) -> None:
        with self._lock:
            self._count += 1
            action = self._actions.pop(self._count, None)
            if action is not None:
                thread = threading.Thread(target=action, name=f"at-{self._count}", daemon=True)
                self._threads.append(thread)
                thread.start()

    @property
    def pending(self) -> int:
        """Actions whose count has not come yet."""
        with self._lock:
            return len(self._actions)

    def join(self, timeout_s: float) -> None:
        """Wait for every started action to end; raises TimeoutError if one is still running then."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"actions still running after {timeout_s:.0f} s: {alive}")


@dataclass(frozen=True)
class LoadRun:
    """A load run's answers (in the cases' order), the requests with no clear answer, and its wall time."""

    outcomes: list[Outcome]
    lost: list[str]
    wall_s: float

    @property
    def errors(self) -> list[str]:
        return [o.error for o in self.outcomes if not o.ok]

    def percentile(self, q: float) -> float:
        """The q-quantile (0..1) of the answered requests' seconds, nearest rank."""
        seconds = sorted(o.seconds for o in self.outcomes)
        return seconds[min(len(seconds) - 1, max(0, round(q * len(seconds)) - 1))] if seconds else float("nan")


def run_load(
    url: str, cases: list[Case], concurrency: int, on_done: Callable[[], None] | None = None, timeout: float = 300.0
) -> LoadRun:
    """run_all, with a request that raises (no answer in `timeout`, a cut without an error) counted as
    lost (an Outcome with error 'lost: ...') instead of ending the run."""
    lost: list[str] = []

    def one(case: Case) -> Outcome:
        t0 = time.monotonic()
        try:
            outcome = run_case(url, case, timeout)
        except Exception as e:  # noqa: BLE001 - a lost request is the run's finding, not its end
            outcome = Outcome(False, error=f"lost: {e!r}", seconds=time.monotonic() - t0)
            lost.append(outcome.error)
        if on_done is not None:
            on_done()
        return outcome

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(one, cases))
    return LoadRun(outcomes, lost, time.monotonic() - t0)


def expected(reference: HasUrl, cases: list[Case]) -> list[Outcome]:
    """The colocated server's answers, asked without streaming (the same greedy output)."""
    refs = run_all(reference.url, [Case(c.kind, c.prompt, False, c.max_tokens) for c in cases])
    assert all(r.ok for r in refs), [r.error for r in refs if not r.ok]
    return refs


def compare(cases: list[Case], got: list[Outcome], want: list[Outcome]) -> list[str]:
    """A line per case that is not the colocated answer: ': error ' in it for a clear error."""
    bad = []
    for i, (case, g, w) in enumerate(zip(cases, got, want)):
        if not g.ok:
            bad.append(f"#{i} {case.kind} stream={case.stream}: error {g.error}")
        elif g.output != w.output:
            bad.append(f"#{i} {case.kind} stream={case.stream}: {g.output!r} != colocated {w.output!r}")
    return bad


def proxy_health(proxy: HasUrl) -> dict[str, Any]:
    return httpx.get(f"{proxy.url}/health", timeout=5).json()


def proxy_metric(proxy: HasUrl, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there is none: callers compare
    differences, and the proxy states its counters at 0 from the start)."""
    text = httpx.get(f"{proxy.url}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
