"""bench_faults.py's scenarios: one connector's 1P1D pair (or a lone server) driven into a fault, outcome timed."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from benchmarks.e2e.configs import ServerSettings, builtin_server
from benchmarks.faults.probes import (
    BUILTIN_EXPIRED,
    LeaseDefault,
    builtin_d_counters,
    builtin_lease_default,
    counter_delta,
    kv_usage,
    last_log_line,
    log_message,
    log_silent_s,
    ours_d_counters,
    ours_lease_default,
    poll_until,
    response_summary,
    send_request,
)
from kvc_testing.cluster import (
    MODULE_FORM,
    generate,
    make_prompts,
    metric,
    output_ids,
    pd_server,
    prefill,
    stats,
)
from kvc_testing.procs import VllmServer

logger = logging.getLogger(__name__)

MAX_TOKENS = 8
# D runs one sequence at a time, so that d-aborted can hold its request in D's queue behind a busy one
# (deterministically: the scheduler does not look at waiting requests while the slot is taken). Every other
# scenario sends D one request at a time.
D_MAX_NUM_SEQS = 1
BUSY_PROMPT_TOKENS = 16
# The busy request generates up to max_model_len: at least this many tokens (2-6 s of D's time here; the
# tiny model has 2048 positions).
BUSY_MIN_TOKENS = 1800
# Most specific first: ours names its error; the built-in's listener thread dies with zmq's.
BIND_ERROR_PATTERNS = ("SideChannelBindError", "Address already in use", "ZMQError")


class Kind(enum.Enum):
    """What a scenario ended in."""

    FREED = "freed"  # P's held blocks were freed
    HELD = "still held"  # ... not by the deadline
    NOT_HELD = "not held"  # P held nothing for D (nothing to measure)
    FAILED = "failed"  # D's request ended with an error
    SERVED = "served"  # D's request answered normally
    WAITING = "still waiting"  # D's request had no answer by the deadline
    EXITED = "exited"  # the server stopped with an error
    NOT_READY = "not ready, not exited"  # neither serving nor stopped by the deadline
    STARTED = "started"  # the server became ready anyway
    ERROR = "error"  # the benchmark could not run the scenario


PAST_DEADLINE = (Kind.HELD, Kind.WAITING, Kind.NOT_READY)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One scenario on one connector: what happened, after how long (None: past the deadline or no figure)."""

    kind: Kind
    seconds: float | None
    detail: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tag: str = ""  # a few words for the table, e.g. "HTTP 500; D ok"

    def to_json(self) -> dict[str, Any]:
        return {
            "outcome": self.kind.value,
            "seconds": None if self.seconds is None else round(self.seconds, 2),
            "timed_out": self.kind in PAST_DEADLINE,
            "tag": self.tag,
            "detail": self.detail,
            **self.data,
        }

    def cell(self, deadline_s: float) -> str:
        """The table cell: outcome (tag), seconds or '> deadline'."""
        head = self.kind.value + (f" ({self.tag})" if self.tag else "")
        if self.seconds is not None:
            return f"{head}, {self.seconds:.1f} s"
        return f"{head}, > {deadline_s:g} s" if self.kind in PAST_DEADLINE else head


@dataclasses.dataclass(frozen=True)
class Connector:
    """How to build one connector's servers and read its counters."""

    name: str
    description: str
    lease: LeaseDefault
    make: Callable[[ServerSettings, str, str, int | None], VllmServer]  # (settings, role, name, side channel)
    d_counters: Callable[[VllmServer], dict[str, float]]
    p_expired: Callable[[VllmServer], float]  # P's count of leases that expired


def _ours_server(settings: ServerSettings, role: str, name: str, side_channel_port: int | None) -> VllmServer:
    return pd_server(
        settings.model, role, form=MODULE_FORM, side_channel_port=side_channel_port, name=name, **settings.server_kwargs()
    )


def _builtin_server(settings: ServerSettings, role: str, name: str, side_channel_port: int | None) -> VllmServer:
    server = builtin_server(settings, role, name)
    if side_channel_port is not None:
        assert server.env is not None
        server.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
        server.side_channel_port = side_channel_port  # type: ignore[attr-defined]
    return server


def connectors() -> dict[str, Connector]:
    """The two connectors compared, each as users run it by default."""
    return {
        "ours": Connector(
            "ours",
            "our NixlConnector (module-path form), pull, default settings",
            ours_lease_default(),
            _ours_server,
            ours_d_counters,
            lambda p: float(stats(p).expired_leases),
        ),
        "builtin": Connector(
            "builtin",
            "vLLM's built-in NixlConnector, kv_buffer_device cpu, as shipped",
            builtin_lease_default(),
            _builtin_server,
            builtin_d_counters,
            lambda p: metric(p.url, BUILTIN_EXPIRED, missing_ok=True),
        ),
    }


class Pair:
    """One connector's D and its current P; a P destroyed by a scenario is replaced on the next ready().

    Every server started is stopped by `stack` (each in its own process group)."""

    def __init__(
        self, connector: Connector, settings: ServerSettings, stack: contextlib.ExitStack, deadline_s: float, prompt_tokens: int
    ) -> None:
        self.connector = connector
        self.settings = settings
        self.stack = stack
        self.deadline_s = deadline_s
        self.prompt_tokens = prompt_tokens
        self.p: VllmServer | None = None
        self.d: VllmServer | None = None
        self._seeds = itertools.count(1)
        self._p_count = itertools.count(1)

    def prompt(self) -> list[int]:
        """A prompt no server of this pair has seen (no prefix-cache hit anywhere)."""
        return make_prompts([self.prompt_tokens], seed=next(self._seeds))[0]

    def _start(self, role: str, name: str) -> VllmServer:
        server = self.connector.make(self.settings, role, name, None)
        if role == "kv_consumer":
            server.argv += ["--max-num-seqs", str(D_MAX_NUM_SEQS)]
        server.start()
        self.stack.callback(server.stop)
        return server

    def ready(self) -> tuple[VllmServer, VllmServer]:
        """P and D up, D having loaded one prompt from this P (a warm pair: D has met P)."""
        fresh = []
        if self.p is None or not self.p.is_running():
            self.p = self._start("kv_producer", f"{self.connector.name}-P{next(self._p_count)}")
            fresh.append(self.p)
        if self.d is None or not self.d.is_running():
            if self.d is not None:
                logger.warning("%s: D exited (code %s); starting another", self.connector.name, self.d.returncode)
            self.d = self._start("kv_consumer", f"{self.connector.name}-D")
            fresh.append(self.d)
        try:
            for server in fresh:
                server.wait_ready()
            if fresh:
                self._warm_up()
        except BaseException:
            for server in fresh:
                server.stop()
            self.p = None if self.p in fresh else self.p
            self.d = None if self.d in fresh else self.d
            raise
        assert self.p is not None and self.d is not None
        return self.p, self.d

    def reference(self, prompt: list[int]) -> list[int]:
        """Greedy output of a plain request on P: what D must answer."""
        assert self.p is not None
        return output_ids(generate(self.p.url, prompt, MAX_TOKENS, timeout=self.deadline_s))

    def _warm_up(self) -> None:
        """One PD request: D must load it from P and answer as P does. Waits until D's counters show the load
        (the built-in publishes them a few seconds late), so later readings start from settled counters."""
        p, d = self.p, self.d
        assert p is not None and d is not None
        prompt = self.prompt()
        expected = self.reference(prompt)
        before = self.connector.d_counters(d)["transfers"]
        params = prefill(p.url, prompt, timeout=self.deadline_s)
        got = output_ids(generate(d.url, prompt, MAX_TOKENS, timeout=self.deadline_s, kv_transfer_params=params))
        if got != expected:
            raise RuntimeError(f"{self.connector.name}: warm-up PD output {got} differs from P's {expected}")
        _, loaded = poll_until(lambda: self.connector.d_counters(d)["transfers"], lambda n: n > before, 15.0)
        if loaded is None:
            raise RuntimeError(f"{self.connector.name}: warm-up: D's transfer counter did not move (no KV loaded)")

    def retire_p(self) -> None:
        if self.p is not None:
            self.p.stop(timeout=5)
            self.p = None


def _settled_usage(pair: Pair, p: VllmServer) -> None:
    """Wait for P's earlier blocks to be freed, so the scenario's are the only ones held."""
    usage, seconds = poll_until(lambda: kv_usage(p), lambda u: u == 0, pair.deadline_s)
    if seconds is None:
        raise RuntimeError(f"P's KV usage still {usage} before the scenario")


def _expired_since(pair: Pair, p: VllmServer, before: float) -> float:
    """P's expired-lease count since `before` (the built-in publishes it with a later step: wait a little)."""
    count, _ = poll_until(lambda: pair.connector.p_expired(p), lambda n: n > before, 3.0)
    return count - before


def _held_usage(p: VllmServer) -> float:
    """P's KV usage once it shows the blocks just held (the gauge follows P's engine steps; a separate
    engine-core process publishes it a little later); 0 if it never does within a few seconds."""
    held, _ = poll_until(lambda: kv_usage(p), lambda u: u > 0, 5.0)
    return held


def d_never_comes(pair: Pair) -> Outcome:
    """P answers a prefill; no D request follows. Seconds until P frees the blocks it holds."""
    p, _ = pair.ready()
    _settled_usage(pair, p)
    expired0 = pair.connector.p_expired(p)
    prefill(p.url, pair.prompt(), timeout=pair.deadline_s)
    t0 = time.monotonic()
    held = _held_usage(p)
    usage, seconds = poll_until(lambda: kv_usage(p), lambda u: u == 0, pair.deadline_s, t0)
    expired = _expired_since(pair, p, expired0)
    lease = pair.connector.lease
    data = {"kv_usage_held": held, "leases_expired": expired, "lease_default_s": lease.seconds, "lease_source": lease.source}
    return _release_outcome(
        pair,
        held,
        usage,
        seconds,
        data,
        "",
        f"({expired:g} lease(s) expired; default lease {lease.seconds} s)",
        "lease" if expired else "",
    )


def _release_outcome(
    pair: Pair, held: float, usage: float, seconds: float | None, data: Mapping[str, Any], said: str, freed: str, tag: str
) -> Outcome:
    """How P's held KV ended: nothing held, still held at the deadline, or freed after `seconds`."""
    if held == 0:
        return Outcome(Kind.NOT_HELD, None, "P's KV usage was 0 right after the prefill: nothing held", data)
    if seconds is None:
        return Outcome(Kind.HELD, None, f"P's KV usage still {usage:.4f} after {pair.deadline_s:g} s{said}", data)
    return Outcome(Kind.FREED, seconds, f"P's KV usage {held:.4f} -> 0 {freed}{said}", data, tag=tag)


class _Busy(threading.Thread):
    """A long streamed generation occupying D's only sequence slot (D_MAX_NUM_SEQS). `running` is set at its
    first chunk (vLLM's running-requests gauge is no proof: it keeps its last value while D is idle)."""

    def __init__(self, d: VllmServer, prompt: list[int], max_tokens: int, deadline_s: float) -> None:
        super().__init__(name="bench-faults-busy", daemon=True)
        self.body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        self.url, self.deadline_s = f"{d.url}/v1/completions", deadline_s
        self.running = threading.Event()
        self.ended: float | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=self.deadline_s) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.running.set()
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            self.ended = time.monotonic()
            self.running.set()  # also on failure: nobody waits for nothing


def _abort_while_queued(d: VllmServer, prompt: list[int], params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """With D busy, send D the request and close the connection: (when it closed, evidence that D had the
    request queued and dropped it)."""
    with send_request(d.url, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params}):
        queued, _ = poll_until(lambda: metric(d.url, "vllm:num_requests_waiting", missing_ok=True), lambda n: n >= 1, 2.0)
    closed = time.monotonic()
    waiting, _ = poll_until(lambda: metric(d.url, "vllm:num_requests_waiting", missing_ok=True), lambda n: n == 0, 2.0)
    return closed, {"queued_on_d": queued >= 1, "d_dropped_it": waiting == 0}


def d_aborted(pair: Pair) -> Outcome:
    """P answers; D gets the request while busy with another (so it waits in D's queue) and the client closes
    the connection. Seconds until P frees the blocks."""
    p, d = pair.ready()
    _settled_usage(pair, p)
    prompt = pair.prompt()
    params = prefill(p.url, prompt, timeout=pair.deadline_s)
    held = _held_usage(p)
    counters0, expired0 = pair.connector.d_counters(d), pair.connector.p_expired(p)
    busy = _Busy(d, pair.prompt()[:BUSY_PROMPT_TOKENS], pair.settings.max_model_len - BUSY_PROMPT_TOKENS - 1, pair.deadline_s)
    busy.start()
    try:
        busy.running.wait(pair.deadline_s)
        t0, evidence = _abort_while_queued(d, prompt, params)
        evidence["d_dropped_it"] = evidence["d_dropped_it"] and busy.is_alive()
        usage, seconds = poll_until(lambda: kv_usage(p), lambda u: u == 0, pair.deadline_s, t0)
    finally:
        busy.join(pair.deadline_s)
    expired = _expired_since(pair, p, expired0)
    data = {
        "kv_usage_held": held,
        **evidence,
        "d_counters": counter_delta(counters0, pair.connector.d_counters(d)),
        "leases_expired": expired,
        "busy_request_error": busy.error,
        "busy_ended_s": None if busy.ended is None else round(busy.ended - t0, 2),
    }
    aborted = evidence["queued_on_d"] and evidence["d_dropped_it"]
    said = (
        f"{'queued on D and dropped at the close' if aborted else 'NOT seen queued and dropped on D'} "
        f"(D's busy request ended {data['busy_ended_s']} s after the close); D's transfer counters "
        f"{data['d_counters']}"
    )
    how = "lease" if expired else "D's notice"
    return _release_outcome(
        pair,
        held,
        usage,
        seconds,
        data,
        f"; {said}",
        f"on {how} ({expired:g} lease(s) expired)",
        how if aborted else f"{how}; abort not seen",
    )


def _plain_check(pair: Pair, d: VllmServer, prompt: list[int], expected: list[int]) -> tuple[bool, str]:
    """Whether D answers a request with no transfer as P would (after a fault)."""
    t0 = time.monotonic()
    try:
        got = output_ids(generate(d.url, prompt, MAX_TOKENS, timeout=pair.deadline_s))
    except (RuntimeError, httpx.HTTPError) as e:
        return False, f"plain request failed after {time.monotonic() - t0:.1f} s: {str(e)[:160]}"
    if got != expected:
        return False, f"plain request answered {got}, P answers {expected}"
    return True, f"plain request correct in {time.monotonic() - t0:.1f} s"


def _ask_d(pair: Pair, d: VllmServer, prompt: list[int], params: dict[str, Any]) -> tuple[httpx.Response | str | None, float]:
    """D's request with P's params: (response, or the transport error text, or None past the deadline; seconds)."""
    t0 = time.monotonic()
    try:
        r: httpx.Response | str | None = generate(d.url, prompt, MAX_TOKENS, timeout=pair.deadline_s, kv_transfer_params=params)
    except httpx.TimeoutException:
        r = None
    except httpx.TransportError as e:
        r = f"no HTTP answer: {type(e).__name__} {e}"
    return r, time.monotonic() - t0


def _p_fault(pair: Pair, sig: signal.Signals) -> Outcome:
    """P answers a prefill, then gets `sig`; D gets the request with P's params. How and when it ends."""
    p, d = pair.ready()
    prompt, plain = pair.prompt(), pair.prompt()
    expected, plain_expected = pair.reference(prompt), pair.reference(plain)
    params = prefill(p.url, prompt, timeout=pair.deadline_s)
    counters0 = pair.connector.d_counters(d)
    assert p.pgid is not None
    try:
        os.killpg(p.pgid, sig)
        if sig == signal.SIGKILL:
            poll_until(p.group_alive, lambda alive: not alive, 10.0)
        answer, seconds = _ask_d(pair, d, prompt, params)
        plain_ok, plain_detail = _plain_check(pair, d, plain, plain_expected)
        counters = counter_delta(counters0, pair.connector.d_counters(d)) if d.is_running() else {}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pgid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
        pair.retire_p()
    data: dict[str, Any] = {
        "d_serves_plain": plain_ok,
        "plain_detail": plain_detail,
        "d_counters": counters,
        "d_alive": d.is_running(),
    }
    d_state = "then D ok" if plain_ok else "then D BROKEN"
    if answer is None:
        data["d_request"] = f"no answer after {pair.deadline_s:g} s"
        return Outcome(Kind.WAITING, None, f"D's request unanswered after {pair.deadline_s:g} s; {plain_detail}", data, tag=d_state)
    if isinstance(answer, str):
        data["d_request"] = answer
        return Outcome(Kind.FAILED, seconds, f"{answer}; {plain_detail}", data, tag=f"no HTTP answer; {d_state}")
    failed, summary, got = response_summary(answer)
    data["d_request"] = summary
    status = summary.split(":")[0].split(",")[0]
    if failed:
        return Outcome(Kind.FAILED, seconds, f"{summary}; {plain_detail}", data, tag=f"{status}; {d_state}")
    data["output_correct"] = got == expected
    correct = "output correct" if got == expected else f"output WRONG ({got} != {expected})"
    return Outcome(
        Kind.SERVED,
        seconds,
        f"{summary}, {correct}; {plain_detail}",
        data,
        tag=f"{'correct' if got == expected else 'WRONG'}; {d_state}",
    )


def p_killed(pair: Pair) -> Outcome:
    return _p_fault(pair, signal.SIGKILL)


def p_frozen(pair: Pair) -> Outcome:
    return _p_fault(pair, signal.SIGSTOP)


def _start_state(server: VllmServer) -> str:
    if not server.is_running():
        return "exited"
    try:
        return "ready" if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200 else "starting"
    except httpx.HTTPError:
        return "starting"


def side_channel_port_in_use(pair: Pair) -> Outcome:
    """A D whose side-channel port another socket holds: seconds until it exits with an error, if it does."""
    c = pair.connector
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = c.make(pair.settings, "kv_consumer", f"{c.name}-D-busy-port", port)
        server.start()
        pair.stack.callback(server.stop)
        try:
            state, seconds = poll_until(lambda: _start_state(server), lambda s: s != "starting", pair.deadline_s)
            message = log_message(server, BIND_ERROR_PATTERNS)
            silent, last = log_silent_s(server), last_log_line(server)
        finally:
            server.stop(timeout=5)
    data: dict[str, Any] = {
        "port": port,
        "log": str(server.log_path),
        "error_in_log": message,
        "exit_code": server.returncode if state == "exited" else None,
    }
    if state == "exited":
        return Outcome(
            Kind.EXITED,
            seconds,
            f"exit code {server.returncode}: {message or last}",
            data,
            tag=f"code {server.returncode}" + ("" if message else ", no bind error in log"),
        )
    if state == "ready":
        return Outcome(Kind.STARTED, seconds, f"serving with its side-channel port {port} taken; log: {message}", data)
    data["log_silent_s"] = round(silent, 1)
    data["ignored_sigterm"] = server.returncode == -signal.SIGKILL  # stop() escalates after 5 s
    sigterm = "; ignored SIGTERM (killed)" if data["ignored_sigterm"] else ""
    return Outcome(
        Kind.NOT_READY,
        None,
        f"not serving, still running after {pair.deadline_s:g} s, log silent for "
        f"{silent:.0f} s; error in log: {message or 'none'}{sigterm}; last line: {last}",
        data,
    )


SCENARIOS: dict[str, Callable[[Pair], Outcome]] = {
    "d-never-comes": d_never_comes,
    "p-killed": p_killed,
    "p-frozen": p_frozen,
    "side-channel-port-in-use": side_channel_port_in_use,
    "d-aborted": d_aborted,
}
# Run order: the lone server first (nothing else up), then what keeps P, then what destroys it.
RUN_ORDER = ("side-channel-port-in-use", "d-never-comes", "d-aborted", "p-killed", "p-frozen")
