"""The first request after start-up, for each shape that takes a handshake between unlike servers, with
every deadline at its default (P's lease, D's handshake and transfer timeouts): P and D start fresh, P
idle after its prefill (nothing else to schedule), one request through the proxy; its answer equals the
colocated server's, and so does the next one's. Servers are not pinned to cores (as users run them),
and the host is loaded: a busy-looping process per core, at the servers' priority, from just before
the first request until after the second (where a 30 s stall was seen: D's handshake or connect
outlived P's lease while P's and D's processes fought for two cores). The quiet host's first request
of a fresh pair is every other e2e module's first request."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvc_testing.cluster import ENTRY_POINT_FORM, MODULE_FORM, ProxyProcess, generate, make_prompts, output_ids, pd_server, stats
from kvc_testing.procs import ManagedProcess, VllmServer
from tests.e2e.conftest import MAX_MODEL_LEN

MAX_TOKENS = 8
# How many cores the busy loops take: every one of this host's (2 on CI).
LOAD_PROCESSES = os.cpu_count() or 2


@dataclass(frozen=True)
class Shape:
    p: dict[str, Any]
    d: dict[str, Any]


SHAPES = {
    "p-tp2-to-d-tp1-pull": Shape({"tp": 2}, {}),
    "p-tp1-to-d-tp2-push": Shape({}, {"tp": 2, "extra_config": {"mode": "push"}}),
    "p-block32-to-d-block64-pull": Shape({}, {"block_size": 64}),
}


@pytest.fixture(params=list(SHAPES), ids=list(SHAPES))
def fresh_pair(request, tiny_model) -> Iterator[tuple[str, VllmServer, VllmServer]]:
    shape = SHAPES[request.param]
    p = pd_server(tiny_model, "kv_producer", form=MODULE_FORM, name="P-first", max_model_len=MAX_MODEL_LEN, **shape.p)
    d = pd_server(tiny_model, "kv_consumer", form=ENTRY_POINT_FORM, name="D-first", max_model_len=MAX_MODEL_LEN, **shape.d)
    with p, d:
        yield request.param, p, d


def test_first_request_after_start_up_equals_colocated(reference, fresh_pair) -> None:
    name, p, d = fresh_pair
    prompts = make_prompts([150, 90], seed=4242)
    want = [output_ids(generate(reference.url, prompt, MAX_TOKENS)) for prompt in prompts]
    with ProxyProcess([p.url], [d.url]) as proxy, contextlib.ExitStack() as load:
        proxy.wait_ready()
        hogs = [
            load.enter_context(ManagedProcess([sys.executable, "-c", "while True: pass"], name=f"busy-{i}"))
            for i in range(LOAD_PROCESSES)
        ]
        seconds = []
        for prompt, expected_ids in zip(prompts, want):
            t0 = time.monotonic()
            r = generate(proxy.url, prompt, MAX_TOKENS, timeout=120)
            seconds.append(round(time.monotonic() - t0, 2))
            assert r.status_code == 200, f"{name}: {r.status_code} {r.text[:300]} after {seconds[-1]} s"
            assert output_ids(r) == expected_ids, name
        assert all(hog.is_running() for hog in hogs), "the host was not loaded throughout"
    print(f"\n{name} (loaded host): first request {seconds[0]} s, second {seconds[1]} s")
    for server in (p, d):  # where the first request's time went: D's handshakes, its loads' phases, P's writes
        for line in server.log_path.read_text(errors="replace").splitlines():
            if any(w in line for w in ("connected to producer", "kv load request", "kv push request")):
                print(f"  {server.name}: {line[-220:]}")
    assert stats(d).recv_transfers >= 2  # D loaded both prompts (it computed neither)
