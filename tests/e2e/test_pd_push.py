"""Push mode over NIXL (P writes into D's blocks when D asks) with real vLLM servers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kv_connectors import sidechannel, wire
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
from kvc_testing.fuzz import server_hash
from kvc_testing.procs import VllmServer, running
from tests.e2e.checks import MAX_TOKENS, PROMPTS, assert_dead_producer_fails_fast, assert_push_matches_colocated
from tests.e2e.conftest import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def push_servers(tiny_model) -> Iterator[dict[str, VllmServer]]:
    """The pushing D, and the P and D the fault tests kill, started together."""
    servers = {
        "decode": pd_server(
            tiny_model,
            "kv_consumer",
            form=ENTRY_POINT_FORM,
            name="D-push",
            max_model_len=MAX_MODEL_LEN,
            extra_config={"mode": "push", "handshake_timeout_s": 5, "transfer_timeout_s": 10},
        ),
        "doomed_p": pd_server(tiny_model, "kv_producer", name="P-push-killed", max_model_len=MAX_MODEL_LEN),
        "doomed_d": pd_server(
            tiny_model, "kv_consumer", name="D-push-killed", max_model_len=MAX_MODEL_LEN, extra_config={"mode": "push"}
        ),
    }
    with running(*servers.values()):
        yield servers


@pytest.fixture(scope="module")
def push_decode(push_servers) -> VllmServer:
    return push_servers["decode"]


@pytest.fixture(scope="module")
def push_proxy(prefill_server, push_decode) -> Iterator[ProxyProcess]:
    with ProxyProcess([prefill_server.url], [push_decode.url]) as p:
        p.wait_ready()
        yield p


def test_nixl_push_greedy_equals_colocated(reference, prefill_server, push_decode, push_proxy):
    assert_push_matches_colocated(reference, prefill_server, push_decode, push_proxy)


def test_push_producer_killed_before_it_writes(reference, prefill_server, push_servers):
    assert_dead_producer_fails_fast(reference, push_servers["doomed_p"], prefill_server, push_servers["decode"])


def test_decode_killed_during_push_fails_the_write_and_frees_producer_blocks(prefill_server, push_servers):
    """D asks P to push, then dies before P's write lands: P's write fails (push_failures), P frees
    the blocks then, not at lease expiry (expired_leases unchanged), and keeps serving.

    The kill cannot be timed between D's push request and P's write (a few ms apart on one host), so
    the test makes that order certain: D hand-shakes with P and completes one push (P is connected
    to D's agent), dies, and then the push request D would have sent reaches P (the test sends it,
    as D does, over P's side channel)."""
    doomed = push_servers["doomed_d"]
    with doomed:
        prompt = PROMPTS[20]
        p0 = stats(prefill_server)
        params = prefill(prefill_server.url, prompt)
        assert output_ids(generate(doomed.url, prompt, MAX_TOKENS, kv_transfer_params=params))
        wait_until(lambda: stats(prefill_server).pushes == p0.pushes + 1, 10, "P to push to the doomed D")
        d_engine = stats(doomed).engine_id
        params = prefill(prefill_server.url, PROMPTS[21])
        doomed.stop(timeout=5)
    p1 = stats(prefill_server)
    assert p1.held_blocks >= len(params["remote_block_ids"]) > 0
    push = wire.PushRequest(
        producer_request_id=params["remote_request_id"],
        consumer_engine_id=d_engine,
        consumer_agent=f"{d_engine}-rank0",
        consumer_request_id="dead-d-request",
        block_ids=list(range(1, len(params["remote_block_ids"]) + 1)),
    )
    port = prefill_server.side_channel_port  # type: ignore[attr-defined]
    ack = sidechannel.request("127.0.0.1", port, push, server_hash(port), 5.0)
    assert isinstance(ack, wire.PushAck) and ack.accepted, ack
    # P's lease is the default 30 s and its write is held past it: only a failed write frees earlier.
    t0 = time.monotonic()
    wait_until(lambda: stats(prefill_server).push_failures == p1.push_failures + 1, 35, "P's write into the dead D to fail")
    wait_until(lambda: stats(prefill_server).held_blocks <= p1.held_blocks - len(params["remote_block_ids"]), 10, "P to free them")
    p2 = stats(prefill_server)
    assert p2.expired_leases == p1.expired_leases, "the blocks were freed by lease expiry, not by the failed write"
    assert p2.pushes == p1.pushes
    print(f"P's write into the dead D failed after {time.monotonic() - t0:.1f} s")
    assert output_ids(generate(prefill_server.url, prompt, 4))
