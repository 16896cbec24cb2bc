"""Our NIXL connector in the module-path form behind the routers users scale out with: vllm-router
(`--vllm-pd-disaggregation --kv-connector nixl`) and SMG (vLLM PD over HTTP, workers registered with
their KV connector), 1P1D and 2P2D on one set of servers. A seeded mix of completions (token ids and
text) and chat, streamed and not, each answer equal to a colocated server's, D's external prefix-cache
hits and our loads proving the KV travelled; SMG started with plain --prefill/--decode URLs is not
disaggregated and D says so; a prefill server killed mid-run behind vllm-router gives no wrong answer.

The routers come from PyPI (kvc_testing/routers.py: .venv/routers, pinned); commands as
docs/deploying-behind-routers.md shows them."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvc_testing import routers
from kvc_testing.cluster import (
    MODULE_FORM,
    MOONCAKE_MODULE_FORM,
    labelled,
    make_prompts,
    metric,
    pd_server,
    stats,
    wait_until,
)
from kvc_testing.procs import VllmServer
from kvc_testing.routers import PINS, RouterProcess, ensure_routers, register_smg_workers, smg, vllm_router
from tests.e2e.conftest import MAX_MODEL_LEN

MAX_TOKENS = 8
CONCURRENCY = 4
D_CONFIG = {"handshake_timeout_s": 5, "transfer_timeout_s": 10}
EXTERNAL = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})  # prompt tokens D loaded
# vllm-router takes a dead P out by its health checks (defaults: every 60 s, 3 failures in a row).
HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2")
VLLM_ROUTER_ARGS = ("--policy", "round_robin", *HEALTH)
SMG_ARGS = ("--policy", "round_robin")
DOC = Path(__file__).resolve().parents[2] / "docs" / "deploying-behind-routers.md"
WORDS = (
    "the garden paper river stone light window morning music table quiet green letter city road winter bread friend story north"
).split()

pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class Ask:
    kind: str  # "ids" (completion, token-id prompt) | "text" (completion) | "chat"
    prompt: Any
    stream: bool
    max_tokens: int = MAX_TOKENS

    def body(self, model: str, stream: bool | None = None) -> tuple[str, dict[str, Any]]:
        stream = self.stream if stream is None else stream
        base: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": 0, "stream": stream}
        if stream:
            base["stream_options"] = {"include_usage": True}
        if self.kind == "chat":
            return "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": self.prompt}]}
        return "/v1/completions", {**base, "prompt": self.prompt, "return_token_ids": True}


@dataclass(frozen=True)
class Answer:
    ok: bool
    output: Any = None  # completions: (output token ids, text, finish reason); chat: (text, finish reason)
    prompt_tokens: int = 0
    error: str = ""


def asks(n: int, seed: int, kinds: Sequence[str] = ("ids", "text", "chat"), max_tokens: int = MAX_TOKENS) -> list[Ask]:
    """n requests, kinds in turn, streamed every other pair; prompts of 1-10 blocks (block 32), their own
    tokens (a seed per test: no D has them cached yet)."""
    rng = random.Random(seed)
    ids = make_prompts([rng.randrange(40, 300) for _ in range(n)], seed=seed)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(20, 150)))
        out.append(Ask(kind, ids[i] if kind == "ids" else text, (i // 2) % 2 == 0, max_tokens))
    return out


def _events(resp: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def ask(url: str, model: str, a: Ask, stream: bool | None = None, timeout: float = 120.0) -> Answer:
    """One request. A clear failure (an HTTP error, an SSE error event, finish_reason "error") is an
    Answer with ok False; anything else (a dropped connection, bad JSON) raises."""
    path, body = a.body(model, stream)
    streamed = body["stream"]
    with httpx.Client(timeout=timeout) as client:
        if not streamed:
            resp = client.post(url + path, json=body)
            if resp.status_code != 200:
                return Answer(False, error=f"HTTP {resp.status_code}: {resp.text[:300]}")
            answer = resp.json()
            choice = answer["choices"][0]
            tokens = (answer.get("usage") or {}).get("prompt_tokens", 0)
            if choice["finish_reason"] == "error":
                return Answer(False, error=f"finish_reason error: {str(choice)[:300]}")
            if a.kind == "chat":
                return Answer(True, (choice["message"]["content"], choice["finish_reason"]), tokens)
            return Answer(True, (choice["token_ids"], choice["text"], choice["finish_reason"]), tokens)
        out_ids: list[int] = []
        text, finish, tokens = "", None, 0
        with client.stream("POST", url + path, json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                return Answer(False, error=f"HTTP {resp.status_code}: {resp.text[:300]}")
            for event in _events(resp):
                if "error" in event:
                    return Answer(False, error=f"stream error event: {str(event['error'])[:300]}")
                tokens = (event.get("usage") or {}).get("prompt_tokens", tokens)
                for choice in event.get("choices", []):
                    out_ids += choice.get("token_ids") or []
                    text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    finish = choice.get("finish_reason") or finish
        if finish == "error":
            return Answer(False, error="stream finish_reason error")
        output = (text, finish) if a.kind == "chat" else (out_ids, text, finish)
        return Answer(True, output, tokens)


def ask_all(url: str, model: str, todo: Sequence[Ask], on_done: Any = None) -> list[Answer]:
    def one(a: Ask) -> Answer:
        answer = ask(url, model, a)
        if on_done is not None:
            on_done()
        return answer

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, todo))


def _wrong(todo: Sequence[Ask], got: Sequence[Answer], want: Sequence[Answer]) -> list[str]:
    """Answers that are neither the colocated output nor a clear failure."""
    return [
        f"#{i} {a.kind} stream={a.stream}: {g.output!r} != colocated {w.output!r}"
        for i, (a, g, w) in enumerate(zip(todo, got, want))
        if g.ok and g.output != w.output
    ]


@dataclass
class Fleet:
    """Two P and two D (module-path form, launched as a user launches them), the session's colocated
    reference, and the routers' bin folder."""

    p: list[VllmServer]
    d: list[VllmServer]
    reference: VllmServer
    model: str
    bin: Path

    def expected(self, todo: Sequence[Ask]) -> list[Answer]:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            want = list(pool.map(lambda a: ask(self.reference.url, self.model, a, stream=False), todo))
        assert all(w.ok for w in want), [w.error for w in want if not w.ok]
        return want

    def check(self, router: RouterProcess, todo: Sequence[Ask], p: Sequence[VllmServer], d: Sequence[VllmServer]) -> str:
        """Every answer through the router equals colocated; each D of `d` loaded its requests' KV from
        P (our loads, vLLM's external prefix-cache hits), each P of `p` prefilled some and freed every
        block. Returns a summary line."""
        want = self.expected(todo)
        assert len({repr(w.output) for w in want}) > len(todo) // 2, "tiny model output is near-constant"
        p0, d0 = [stats(s) for s in p], [stats(s) for s in d]
        ext0 = [labelled(s.url, *EXTERNAL) for s in d]
        t0 = time.monotonic()
        got = ask_all(router.url, self.model, todo)
        wall = time.monotonic() - t0
        failed = [f"#{i} {a.kind} stream={a.stream}: {g.error}" for i, (a, g) in enumerate(zip(todo, got)) if not g.ok]
        assert not failed, f"{len(failed)} of {len(todo)} failed: {failed[:5]}"
        wrong = _wrong(todo, got, want)
        assert not wrong, f"{len(wrong)} of {len(todo)} differ from colocated: {wrong[:3]}"
        loads = [stats(s).recv_transfers - s0.recv_transfers for s, s0 in zip(d, d0)]
        assert sum(loads) == len(todo), f"D loads {loads} for {len(todo)} requests: not every prompt's KV came from P"
        assert all(n > 0 for n in loads), f"a D served none: loads {loads}"
        assert all(stats(s).recv_failures == s0.recv_failures for s, s0 in zip(d, d0))
        prompt_tokens = sum(w.prompt_tokens for w in want)
        external = [labelled(s.url, *EXTERNAL) - e0 for s, e0 in zip(d, ext0)]
        # vLLM counts a loaded prompt's tokens as external hits (D recomputes at most the last one).
        assert sum(external) >= prompt_tokens - len(todo), f"D's external KV hits {external} for {prompt_tokens} prompt tokens"
        for s in p:
            wait_until(lambda s=s: stats(s).held_blocks == 0, 40, f"{s.name} to free the blocks D loaded")
        sends = [stats(s).completed_sends - s0.completed_sends for s, s0 in zip(p, p0)]
        assert sum(sends) == len(todo) and all(n > 0 for n in sends), f"P completed sends {sends} for {len(todo)} requests"
        kinds = {k: sum(a.kind == k for a in todo) for k in ("ids", "text", "chat")}
        return (
            f"{router.command} {len(p)}P{len(d)}D: {len(todo)}/{len(todo)} equal to colocated "
            f"({kinds}, {sum(a.stream for a in todo)} streamed) in {wall:.1f} s; D loads {loads}, "
            f"external KV tokens {[int(x) for x in external]} of {prompt_tokens} prompt tokens; P sends {sends}"
        )


@pytest.fixture(scope="module")
def fleet(tiny_model, request) -> Iterator[Fleet]:
    """P1, P2, D1, D2 boot while the routers install (first use) and the session's reference starts."""
    p = [pd_server(tiny_model, "kv_producer", form=MODULE_FORM, name=f"P{i}", max_model_len=MAX_MODEL_LEN) for i in (1, 2)]
    d = [
        pd_server(tiny_model, "kv_consumer", form=MODULE_FORM, name=f"D{i}", max_model_len=MAX_MODEL_LEN, extra_config=D_CONFIG)
        for i in (1, 2)
    ]
    try:
        for server in (*p, *d):
            server.start()
        bin_dir = ensure_routers()  # a failed install fails the tests here, with pip's output
        reference = request.getfixturevalue("reference")
        for server in (*p, *d):
            server.wait_ready()
        yield Fleet(p, d, reference, str(tiny_model), bin_dir)
    finally:
        for server in (*p, *d):
            server.stop()


def _doc_commands(command: str) -> list[list[str]]:
    """The docs page's `command ...` lines (continuations joined), as tokens."""
    text = DOC.read_text().replace("\\\n", " ")
    return [shlex.split(line.strip()) for line in text.splitlines() if line.strip().startswith(command + " ")]


def test_the_docs_page_shows_the_commands_this_suite_runs() -> None:
    """docs/deploying-behind-routers.md: each router command has the flags the tests pass, each of its
    flags is in the installed router's --help, and the pins are the suite's."""
    bin_dir = ensure_routers()
    suite = {
        "vllm-router": vllm_router(bin_dir, ["http://p"], ["http://d"], *VLLM_ROUTER_ARGS).cli_args(),
        "smg": smg(bin_dir, *SMG_ARGS).cli_args(),
    }
    for command, args in suite.items():
        shown = _doc_commands(command)
        assert len(shown) == 1, f"{DOC.name} shows {len(shown)} `{command}` commands"
        (line,) = shown
        help_text = subprocess.run([str(bin_dir / command), *line[1:2], "--help"], capture_output=True, text=True).stdout
        for flag in (t for t in line[1:] if t.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), f"{command}: {flag} is not in its --help"
        want = {t for t in args if t.startswith("--")}
        assert want <= set(line), f"{DOC.name}'s `{command}` lacks {want - set(line)}"
        assert f"pip install {command}=={PINS[command]}" in DOC.read_text()


def test_a_failed_router_install_fails_with_pips_own_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The set-up never skips: a version pip cannot find (or no registry) is an error naming pip's output."""
    monkeypatch.setattr(routers, "PINS", {"vllm-router": "999.0.0"})
    with pytest.raises(RuntimeError) as failed:
        routers.ensure_routers(tmp_path / "routers", timeout=300)
    text = str(failed.value)
    assert "pip install of the routers failed" in text and "vllm-router==999.0.0" in text, text
    assert "No matching distribution" in text or "ERROR" in text, text
    assert not (tmp_path / "routers" / ".kvc-routers").exists()


def _router(r: RouterProcess) -> RouterProcess:
    r.start()
    try:
        r.wait_ready()
    except BaseException:
        r.stop()
        raise
    return r


def test_vllm_router_1p1d_equals_colocated(fleet: Fleet) -> None:
    """Its default policy (cache_aware) first asks P and D to render the request (POST
    /v1/completions/render, /v1/chat/completions/render), which vLLM refuses (403) unless started with
    --enable-scale-out; the router then routes on the text."""
    p, d = fleet.p[:1], fleet.d[:1]
    router = _router(vllm_router(fleet.bin, [s.url for s in p], [s.url for s in d], *HEALTH))
    with router:
        print("\n" + fleet.check(router, asks(12, seed=101), p, d))


def test_vllm_router_2p2d_equals_colocated(fleet: Fleet) -> None:
    router = _router(vllm_router(fleet.bin, [s.url for s in fleet.p], [s.url for s in fleet.d], *VLLM_ROUTER_ARGS))
    with router:
        print("\n" + fleet.check(router, asks(16, seed=102), fleet.p, fleet.d))


def test_smg_1p1d_equals_colocated(fleet: Fleet) -> None:
    """SMG refuses token-id prompts on /v1/completions (its request type takes a string or strings):
    text completions and chat only."""
    p, d = fleet.p[:1], fleet.d[:1]
    router = _router(smg(fleet.bin, *SMG_ARGS))
    with router:
        register_smg_workers(router, [s.url for s in p], [s.url for s in d])
        print("\n" + fleet.check(router, asks(12, seed=103, kinds=("text", "chat")), p, d))
        refused = ask(router.url, fleet.model, Ask("ids", [5, 6, 7, 8, 9], stream=False))
        assert not refused.ok and "HTTP 400" in refused.error and "prompt" in refused.error, refused
        print(f"smg, token-id prompt: {refused.error[:160]}")


def test_smg_2p2d_equals_colocated(fleet: Fleet) -> None:
    router = _router(smg(fleet.bin, *SMG_ARGS))
    with router:
        register_smg_workers(router, [s.url for s in fleet.p], [s.url for s in fleet.d])
        print("\n" + fleet.check(router, asks(16, seed=104, kinds=("text", "chat")), fleet.p, fleet.d))


def test_smg_with_plain_urls_is_not_disaggregated_and_d_says_so(fleet: Fleet) -> None:
    """`smg launch --pd-disaggregation --prefill URL --decode URL` registers no KV connector: it sends P's
    request without do_remote_decode and D's without P's kv_transfer_params, so D computes every prompt
    itself. Answers stay exact and nothing moves; D counts each such request and warns, naming the cause."""
    p, d = fleet.p[0], fleet.d[0]
    router = _router(smg(fleet.bin, "--prefill", p.url, "--decode", d.url, *SMG_ARGS))
    todo = asks(4, seed=105, kinds=("text", "chat"))
    want = fleet.expected(todo)
    with router:
        d0 = stats(d)
        unpaired0 = metric(d.url, "kvc:requests_without_params_total")
        got = ask_all(router.url, fleet.model, todo)
        assert all(g.ok for g in got) and not _wrong(todo, got, want), (got, want)
        assert stats(d).recv_transfers == d0.recv_transfers  # the trap: exact answers, no transfer
        wait_until(
            lambda: metric(d.url, "kvc:requests_without_params_total") - unpaired0 == len(todo),
            10,
            "D to count the requests that came without P's kv_transfer_params",
        )
        d.wait_log("without a prefill instance's kv_transfer_params", 10)


def test_prefill_killed_mid_run_behind_vllm_router_gives_no_wrong_answer(fleet: Fleet) -> None:
    """Last in this module: P2 is SIGKILLed after a quarter of the requests. Each answer equals colocated
    or fails clearly (HTTP error, error event), none hangs; vllm-router does not retry a refused prefill
    on the other one but its health checks (HEALTH) take P2 out, after which every request is served."""
    victim, survivor = fleet.p[1], fleet.p[0]
    urls = [s.url for s in fleet.p], [s.url for s in fleet.d]
    router = _router(vllm_router(fleet.bin, *urls, *VLLM_ROUTER_ARGS))
    todo = asks(24, seed=106, max_tokens=32)
    want = fleet.expected(todo)
    done, lock, kill_now = [0], threading.Lock(), threading.Event()

    def on_done() -> None:
        with lock:
            done[0] += 1
            if done[0] == len(todo) // 4:
                kill_now.set()

    killer = threading.Thread(target=lambda: kill_now.wait(300) and os.killpg(victim.pgid, signal.SIGKILL))  # type: ignore[arg-type]
    with router:
        killer.start()
        t0 = time.monotonic()
        got = ask_all(router.url, fleet.model, todo, on_done)
        wall = time.monotonic() - t0
        killer.join()
        killed_at = time.monotonic()
        victim.stop()
        assert not victim.group_alive()
        wrong = _wrong(todo, got, want)
        assert not wrong, wrong
        errors = [g.error for g in got if not g.ok]
        # Until its health checks take P2 out, the router sends every other request to it (HTTP 500).
        probe = asks(40, seed=107)
        want_probe = fleet.expected(probe)
        in_a_row, failed_after, n = 0, [], 0
        while in_a_row < 4:
            assert n < len(probe) and time.monotonic() - killed_at < 60, f"P2 still routed to: {failed_after[-3:]}"
            answer = ask(router.url, fleet.model, probe[n])
            assert not _wrong(probe[n : n + 1], [answer], want_probe[n : n + 1])
            in_a_row = in_a_row + 1 if answer.ok else 0
            failed_after += [] if answer.ok else [answer.error]
            n += 1
            time.sleep(0.25)
        evicted_s = time.monotonic() - killed_at
        after = probe[n : n + 6]
        s0 = stats(survivor).completed_sends
        got_after = ask_all(router.url, fleet.model, after)
        assert all(g.ok for g in got_after) and not _wrong(after, got_after, want_probe[n : n + 6]), got_after
        assert stats(survivor).completed_sends - s0 == len(after)
        print(
            f"\nvllm-router 2P2D, P2 killed after {len(todo) // 4} of {len(todo)}: {len(todo) - len(errors)} equal to "
            f"colocated, {len(errors)} clear errors in {wall:.1f} s {sorted({e[:120] for e in errors})}; "
            f"{len(failed_after)} more failed until P2 was out ({evicted_s:.1f} s after the kill), "
            f"then {len(after)}/{len(after)} served by P1"
        )
        assert len(errors) <= len(todo) // 2, errors
        wait_until(lambda: stats(survivor).held_blocks == 0, 40, "P1 to free every block")


def test_our_mooncake_connector_behind_vllm_router_in_nixl_mode(
    fleet: Fleet, tiny_model: Path, mooncake_prefill: VllmServer
) -> None:
    """vllm-router's `--kv-connector mooncake` asks each P for the bootstrap server of vLLM's built-in
    MooncakeConnector (http://P_HOST:8998/query), which ours does not run. Our MooncakeConnector (push
    by default: D asks, P writes into D's blocks) answers the NIXL-style flow, so `--kv-connector nixl`
    serves it. After the fault case, whose dead P2 leaves room for this D (P is the session's)."""
    p = mooncake_prefill
    d = pd_server(
        tiny_model, "kv_consumer", form=MOONCAKE_MODULE_FORM, name="MD", max_model_len=MAX_MODEL_LEN, extra_config=D_CONFIG
    )
    with d, _router(vllm_router(fleet.bin, [p.url], [d.url], *VLLM_ROUTER_ARGS)) as router:
        pushes0 = stats(p).pushes
        todo = asks(9, seed=108)
        print("\nMooncake, " + fleet.check(router, todo, [p], [d]))
        assert stats(p).pushes - pushes0 == len(todo), "P did not write every prompt into D (push)"
