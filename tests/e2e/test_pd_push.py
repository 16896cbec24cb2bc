"""Push mode over NIXL (P writes into D's blocks when D asks) with real vLLM servers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvc_testing.cluster import (
    ENTRY_POINT_FORM,
    ProxyProcess,
    generate,
    output_ids,
    pd_server,
    prefill,
    stats,
    wait_until,
)
from kvc_testing.procs import VllmServer
from tests.e2e.checks import MAX_TOKENS, PROMPTS, assert_dead_producer_fails_fast, assert_pd_matches_colocated
from tests.e2e.conftest import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def push_decode(tiny_model) -> Iterator[VllmServer]:
    server = pd_server(
        tiny_model,
        "kv_consumer",
        form=ENTRY_POINT_FORM,
        name="D-push",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"mode": "push", "handshake_timeout_s": 5, "transfer_timeout_s": 10},
    )
    with server:
        yield server


@pytest.fixture(scope="module")
def push_proxy(prefill_server, push_decode) -> Iterator[ProxyProcess]:
    with ProxyProcess([prefill_server.url], [push_decode.url]) as p:
        p.wait_ready()
        yield p


def test_nixl_push_greedy_equals_colocated(reference, prefill_server, push_decode, push_proxy):
    p0 = stats(prefill_server)
    assert_pd_matches_colocated(reference, prefill_server, push_decode, push_proxy)
    assert stats(prefill_server).pushes - p0.pushes == len(PROMPTS), "P did not write the blocks"


def test_push_producer_killed_before_it_writes(tiny_model, reference, prefill_server, push_decode):
    doomed = pd_server(tiny_model, "kv_producer", name="P-push-killed", max_model_len=MAX_MODEL_LEN)
    assert_dead_producer_fails_fast(reference, doomed, prefill_server, push_decode)


def test_decode_killed_during_push_frees_producer_blocks(tiny_model, prefill_server):
    """D dies while its request is in flight: P frees the blocks (write failed, or lease) and keeps serving."""
    doomed = pd_server(tiny_model, "kv_consumer", name="D-push-killed", max_model_len=MAX_MODEL_LEN, extra_config={"mode": "push"})
    with doomed:
        prompt = PROMPTS[20]
        params = prefill(prefill_server.url, prompt)
        sender = threading.Thread(
            target=lambda: _quietly(generate, doomed.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=30)
        )
        sender.start()
        time.sleep(0.05)
        doomed.stop(timeout=1)
        sender.join(60)
    # P's lease in the session fixture is the default 30 s; a failed write frees at once.
    wait_until(lambda: stats(prefill_server).held_blocks == 0, 45, "P to free the blocks of the dead D")
    assert output_ids(generate(prefill_server.url, prompt, 4))


def _quietly(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception:  # the server is killed under the request: any outcome is fine here
        pass
