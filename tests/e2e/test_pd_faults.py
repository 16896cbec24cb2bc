"""Faults with real vLLM servers: each gives a clear error or a failed request within a deadline,
P's blocks are always freed, and D keeps serving."""

from __future__ import annotations

import socket
import time

import pytest

from kvc_testing.cluster import generate, make_prompts, output_ids, pd_server, prefill, stats, wait_until
from kvc_testing.procs import running, stop_all
from kvc_testing.tiny_model import build_tiny_model
from tests.e2e.conftest import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def faulty(tiny_model):
    """This module's own servers, started together: a P for requests that go wrong, with a short lease,
    so the main P stays clean; a P of another model; P's that tests kill; a D that recomputes."""
    servers = {
        "scratch": pd_server(tiny_model, "kv_producer", name="P-scratch", max_model_len=MAX_MODEL_LEN, extra_config={"lease_s": 3}),
        "other": pd_server(build_tiny_model(variant="base"), "kv_producer", name="P-other", max_model_len=MAX_MODEL_LEN),
        "killed": pd_server(tiny_model, "kv_producer", name="P-killed", max_model_len=MAX_MODEL_LEN),
        "doomed": pd_server(tiny_model, "kv_producer", name="P-doomed", max_model_len=MAX_MODEL_LEN),
        "recompute": pd_server(
            tiny_model,
            "kv_consumer",
            name="D-recompute",
            max_model_len=MAX_MODEL_LEN,
            extra_config={"handshake_timeout_s": 3, "transfer_timeout_s": 5},
            transfer_config={"kv_load_failure_policy": "recompute"},
        ),
    }
    # The two start-up refusals start now too, unwaited: their tests look at how they ended.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        busy_port = pd_server(tiny_model, "kv_producer", side_channel_port=port, name="P-busy-port", max_model_len=MAX_MODEL_LEN)
        pp2 = pd_server(tiny_model, "kv_consumer", name="D-pp2", max_model_len=MAX_MODEL_LEN, multiprocessing=True, cpu_bind="0|1")
        pp2.argv += ["--pipeline-parallel-size", "2"]
        try:
            for refused in (busy_port, pp2):
                refused.start()
            with running(*servers.values()):
                yield {**servers, "busy_port": busy_port, "pp2": pp2}
        finally:
            stop_all([busy_port, pp2])


@pytest.fixture(scope="module")
def scratch_prefill(faulty):
    return faulty["scratch"]


PROMPT = make_prompts([100], seed=3)[0]
DEADLINE_S = 30  # D's handshake_timeout_s + transfer_timeout_s is 15 s in conftest


def _assert_failed_quickly(decode_server, params, prompt=PROMPT):
    d0 = stats(decode_server)
    t0 = time.monotonic()
    r = generate(decode_server.url, prompt, 8, kv_transfer_params=params, timeout=DEADLINE_S + 30)
    elapsed = time.monotonic() - t0
    assert elapsed < DEADLINE_S, f"failure took {elapsed:.1f} s"
    failed = r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error"
    assert failed, f"expected a failed request, got {r.status_code} {r.text[:300]}"
    assert stats(decode_server).recv_failures == d0.recv_failures + 1
    return r


def _assert_decode_still_serves(reference, prefill_server, decode_server):
    prompt = make_prompts([77], seed=11)[0]
    params = prefill(prefill_server.url, prompt)
    got = output_ids(generate(decode_server.url, prompt, 8, kv_transfer_params=params))
    assert got == output_ids(generate(reference.url, prompt, 8))


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda p: {**p, "remote_block_ids": "1,2,3"}, id="block-ids-not-a-list"),
        pytest.param(lambda p: {**p, "remote_block_ids": [10**9] * len(p["remote_block_ids"])}, id="block-id-out-of-range"),
        pytest.param(lambda p: {**p, "remote_block_ids": p["remote_block_ids"][:1]}, id="too-few-blocks"),
        pytest.param(lambda p: {k: v for k, v in p.items() if k != "remote_engine_id"}, id="missing-engine-id"),
        pytest.param(lambda p: {**p, "remote_port": "x"}, id="port-not-int"),
        pytest.param(lambda p: {**p, "remote_num_tokens": 3}, id="prompt-mismatch"),
        pytest.param(lambda p: {**p, "remote_engine_id": "no-such-engine"}, id="wrong-engine"),
    ],
)
def test_malformed_kv_transfer_params_fail_the_request(reference, prefill_server, decode_server, scratch_prefill, mutate):
    params = prefill(scratch_prefill.url, PROMPT)
    _assert_failed_quickly(decode_server, mutate(params))
    _assert_decode_still_serves(reference, prefill_server, decode_server)
    # Whatever D was sent, P's blocks are freed: by D's notice, or by the lease (3 s here).
    wait_until(lambda: stats(scratch_prefill).held_blocks == 0, 10, "P to free the blocks")


@pytest.mark.parametrize(
    "d_prompt, why",
    [
        (make_prompts([100], seed=4)[0], "differ from the prefill request's prompt"),
        (PROMPT[:60], "prefill had 100 prompt tokens, this request has 60"),
    ],
    ids=["same-length-other-prompt", "shorter"],
)
def test_decode_request_for_another_prompt_fails_instead_of_decoding_from_its_kv(
    reference, prefill_server, decode_server, scratch_prefill, d_prompt, why
):
    """P's params carry a digest of its prompt: D refuses P's KV for a prompt that is not P's (a proxy
    that mixed up two requests of the same length used to get another prompt's tokens, answered 200)."""
    assert d_prompt != PROMPT
    params = prefill(scratch_prefill.url, PROMPT)
    _assert_failed_quickly(decode_server, params, prompt=d_prompt)
    assert why in decode_server.log_tail(300), "D's log does not say why"
    _assert_decode_still_serves(reference, prefill_server, decode_server)
    wait_until(lambda: stats(scratch_prefill).held_blocks == 0, 10, "P to free the blocks")


def test_incompatible_peer_is_refused(reference, prefill_server, decode_server, faulty):
    other = faulty["other"]
    params = prefill(other.url, PROMPT)
    _assert_failed_quickly(decode_server, params)
    other.stop()
    log = decode_server.log_tail(400)
    assert "incompatible peer" in log, "D's log does not say why"
    assert "num_layers: server=8 client=2" in log
    # D told P nothing it could use, so P's lease frees the blocks (checked in the lease test);
    # D keeps serving others.
    _assert_decode_still_serves(reference, prefill_server, decode_server)


def test_lease_frees_blocks_when_decode_never_comes(scratch_prefill):
    wait_until(lambda: stats(scratch_prefill).held_blocks == 0, 10, "earlier leases to end")
    expired = stats(scratch_prefill).expired_leases
    prefill(scratch_prefill.url, PROMPT)
    held = stats(scratch_prefill)
    assert held.held_requests == 1 and held.held_blocks == 4
    wait_until(lambda: stats(scratch_prefill).held_blocks == 0, 15, "the lease to free P's blocks")
    assert stats(scratch_prefill).expired_leases == expired + 1


def test_producer_killed_before_decode_reads(reference, prefill_server, decode_server, faulty):
    server = faulty["killed"]
    params = prefill(server.url, PROMPT)
    server.stop()
    _assert_failed_quickly(decode_server, params)
    _assert_decode_still_serves(reference, prefill_server, decode_server)


def test_side_channel_port_in_use_fails_start_up(faulty):
    server = faulty["busy_port"]  # started with the module's servers, its side-channel port held
    log = _refused_at_start_up(server, 180, "server kept running with its side-channel port taken")
    port = server.side_channel_port
    assert "side_channel_port" in log and str(port) in log, log[-2000:]


def _refused_at_start_up(server, timeout_s: float, why_not: str) -> str:
    """The server (started already, or now) exits by itself within timeout_s; its log tail."""
    if server.pid is None:
        server.start()
    try:
        deadline = time.monotonic() + timeout_s
        while server.is_running() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not server.is_running(), why_not
        return server.log_tail(300)
    finally:
        server.stop()


def test_recompute_policy_recovers_when_producer_dies(reference, faulty):
    """With vLLM's kv_load_failure_policy=recompute a failed load is recomputed on D: same output."""
    server, producer = faulty["recompute"], faulty["doomed"]
    params = prefill(producer.url, PROMPT)
    producer.stop()
    t0 = time.monotonic()
    got = output_ids(generate(server.url, PROMPT, 8, kv_transfer_params=params, timeout=60))
    assert time.monotonic() - t0 < DEADLINE_S
    assert got == output_ids(generate(reference.url, PROMPT, 8))
    assert stats(server).recv_failures == 1


def test_pipeline_parallel_instance_is_refused_at_start_up(faulty):
    """PP 2 would have each stage load the peer's layers of stage 0 (wrong tokens): refused. TP is
    served rank to rank (test_pd_tp.py)."""
    log = _refused_at_start_up(faulty["pp2"], 240, "a PP 2 instance with our connector kept running")
    assert "pipeline_parallel_size 1 only" in log, log[-2000:]
