"""Push mode over NIXL (P writes into D's blocks when D asks) with real vLLM servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv_connectors.testing.cluster import ENTRY_POINT_FORM, ProxyProcess, pd_server, stats
from kv_connectors.testing.procs import VllmServer
from tests.e2e.checks import PROMPTS, assert_pd_matches_colocated
from tests.e2e.conftest import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def push_decode(tiny_model) -> Iterator[VllmServer]:
    server = pd_server(
        tiny_model, "kv_consumer", form=ENTRY_POINT_FORM, name="D-push", max_model_len=MAX_MODEL_LEN,
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
