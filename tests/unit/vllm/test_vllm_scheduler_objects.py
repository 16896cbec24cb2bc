"""The scheduler side driven with vLLM's real objects (tests/unit/vllm/vllm_objects.py): Request,
KVCacheBlocks, SchedulerOutput / NewRequestData, and both stand-ins vLLM sends only to run
request_finished. The assertions of test_scheduler_side.py (which uses stand-ins of its own) hold on
vLLM's objects; a renamed or retyped vLLM field fails here. `make test-vllm-next` runs this file on
vLLM 0.33's sources."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from kv_connectors.config import parse_config
from kv_connectors.params import prompt_digest
from kv_connectors.vllm.scheduler import SchedulerSide
from tests.unit.engine.engine_harness import FakeClock
from tests.unit.vllm.vllm_objects import (
    BLOCK,
    blocks,
    busy_step,
    finish,
    paused_stand_in,
    rejected_stand_in,
    request,
    step,
)

EMPTY = step()  # vLLM's SchedulerOutput.make_empty(): nothing scheduled
P_ADDR = ("P", "127.0.0.1", 7001)


def _d_params(key: str, n_tokens: int = 64) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2],
        "remote_engine_id": "P",
        "remote_request_id": key,
        "remote_host": "127.0.0.1",
        "remote_port": 7001,
        "remote_num_tokens": n_tokens,
    }


def _d_side(clock: FakeClock | None = None, tp_size: int = 1, **extra) -> SchedulerSide:
    return SchedulerSide(parse_config("D", "kv_consumer", extra), BLOCK, 7002, clock=clock or FakeClock(), tp_size=tp_size)


def _p_side(tp_size: int = 1, **extra) -> SchedulerSide:
    return SchedulerSide(parse_config("P", "kv_producer", extra), BLOCK, 7001, clock=FakeClock(), tp_size=tp_size)


def _p_params(prompt: list[int], block_ids: list[int]) -> dict:
    """What P's scheduler side returns for a finished prefill of `prompt` (a real vLLM request)."""
    p = _p_side()
    r = request("p-req", prompt, {"do_remote_decode": True}, max_tokens=1)
    assert p.get_num_new_matched_tokens(r, 0) == (0, False)
    delay, params = p.request_finished(finish(r, RequestStatus.FINISHED_LENGTH_CAPPED), block_ids)
    assert delay and params is not None
    return params


def test_queued_requests_get_heartbeats_until_scheduled_or_finished():
    clock = FakeClock()
    side = _d_side(clock, lease_renew_after_s=1.0)
    a, b, c = (request(rid, list(range(64)), _d_params("k" + rid)) for rid in "abc")
    side.on_new_request(a)
    side.on_new_request(b)
    clock.advance(0.5)
    side.on_new_request(c)
    assert not side.build_connector_meta(EMPTY).renew_start, "a request scheduled at once needs no heartbeat"
    clock.advance(0.6)  # a and b queued 1.1 s, c 0.6 s
    meta = side.build_connector_meta(EMPTY)
    assert meta.renew_start == {"a": (P_ADDR, "ka", None), "b": (P_ADDR, "kb", None)}
    assert side.get_num_new_matched_tokens(a, 0) == (64, True)
    side.update_state_after_alloc(a, blocks([5, 6]), 64)
    side.request_finished(finish(b, RequestStatus.FINISHED_ABORTED), [])  # aborted while queued
    meta = side.build_connector_meta(EMPTY)
    assert meta.renew_stop == {"a", "b"} and "a" in meta.reqs_to_recv
    clock.advance(1.0)
    assert set(side.build_connector_meta(EMPTY).renew_start) == {"c"}


def test_requests_without_remote_prefill_are_not_tracked():
    clock = FakeClock()
    side = _d_side(clock)
    side.on_new_request(request("x", [1, 2, 3], None))
    side.on_new_request(request("y", list(range(64)), {"do_remote_prefill": True, "remote_block_ids": "nope"}))
    clock.advance(10)
    assert not side.build_connector_meta(EMPTY).renew_start


def test_params_are_parsed_once_per_request_and_forgotten_when_it_finishes(monkeypatch):
    import kv_connectors.vllm.scheduler as scheduler

    calls: list[object] = []
    parse = scheduler.parse_request_params

    def counting(params):
        calls.append(params)
        return parse(params)

    monkeypatch.setattr(scheduler, "parse_request_params", counting)
    side = _d_side()
    a = request("a", list(range(64)), _d_params("ka"))
    side.on_new_request(a)
    assert side.get_num_new_matched_tokens(a, 0) == (64, True)
    assert side.get_num_new_matched_tokens(a, 0) == (64, True)
    side.update_state_after_alloc(a, blocks([5, 6]), 64)
    assert side.request_finished(finish(a, RequestStatus.FINISHED_STOPPED), [5, 6]) == (False, None)
    assert len(calls) == 1 and "a" in side.build_connector_meta(EMPTY).reqs_to_recv
    assert not side._params, "a finished request's params are kept"

    p = _p_side()
    r = request("r", list(range(64)), {"do_remote_decode": True, "transfer_id": "t-1"}, max_tokens=1)
    calls.clear()
    assert p.get_num_new_matched_tokens(r, 0) == (0, False)
    delay, params = p.request_finished(finish(r, RequestStatus.FINISHED_LENGTH_CAPPED), [3, 4])
    assert delay and params is not None and params["remote_request_id"] == "t-1" and params["transfer_id"] == "t-1"
    assert len(calls) == 1 and not p._params


def test_the_prefills_tp_size_travels_from_p_to_d_workers():
    clock = FakeClock()
    side = _d_side(clock, tp_size=2, lease_renew_after_s=1.0)
    a, b, q = (request(rid, list(range(64)), {**_d_params("k" + rid), "tp_size": 1}) for rid in "abq")
    for r in (a, b, q):
        side.on_new_request(r)
    clock.advance(2.0)
    assert side.build_connector_meta(EMPTY).renew_start["q"][2] == 1
    side.get_num_new_matched_tokens(a, 0)
    side.update_state_after_alloc(a, blocks([5, 6]), 64)
    side.get_num_new_matched_tokens(b, 64)
    side.update_state_after_alloc(b, blocks([], hits=[5, 6]), 0)  # every block a local hit: a release
    meta = side.build_connector_meta(EMPTY)
    assert meta.reqs_to_recv["a"].remote_tp_size == 1 and meta.reqs_to_recv["a"].report
    assert meta.reqs_to_recv["b"].remote_tp_size == 1 and not meta.reqs_to_recv["b"].report

    p = _p_side(tp_size=2)
    r = request("r", list(range(64)), {"do_remote_decode": True}, max_tokens=1)
    assert p.request_finished(finish(r, RequestStatus.FINISHED_LENGTH_CAPPED), [3, 4])[1]["tp_size"] == 2


def test_a_prefill_with_another_block_size_loads_the_tokens_d_lacks():
    side = _d_side()
    a = request("a", list(range(64)), {**_d_params("ka"), "remote_block_ids": [11, 12, 13, 14], "remote_block_size": 16})
    assert side.get_num_new_matched_tokens(a, 32) == (32, True)
    side.update_state_after_alloc(a, blocks([9], hits=[1]), 32)
    spec = side.build_connector_meta(EMPTY).reqs_to_recv["a"]
    assert spec.local_block_ids == (9,) and spec.remote_block_ids == (13, 14)
    assert (spec.tokens.first, spec.tokens.count, spec.tokens.dst_start, spec.tokens.src_start) == (32, 32, 32, 32)

    b = request("b", list(range(64)), {**_d_params("kb"), "remote_block_ids": [11, 12, 13], "remote_block_size": 16})
    side.get_num_new_matched_tokens(b, 0)
    side.update_state_after_alloc(b, blocks([5, 6]), 64)
    assert "remote_block_ids has 3 blocks, the prompt fills 4" in side.build_connector_meta(EMPTY).reqs_failed["b"]


def test_null_blocks_and_prefix_hits_are_not_loaded():
    """vLLM's allocation may begin with null blocks (never cached, never loaded) and local prefix
    hits (hashed): only the new blocks pair with P's tail."""
    params = _p_params(list(range(96)), [7, 8, 9])
    side = _d_side()
    d = request("d", list(range(96)), params)
    assert side.get_num_new_matched_tokens(d, 32) == (64, True)
    side.update_state_after_alloc(d, blocks([5, 6], hits=[3], nulls=1), 64)
    spec = side.build_connector_meta(EMPTY).reqs_to_recv["d"]
    assert (spec.local_block_ids, spec.remote_block_ids, spec.tokens.first, spec.tokens.count) == ((5, 6), (8, 9), 32, 64)


def test_p_states_a_digest_of_its_prompt():
    params = _p_params(list(range(70)), [7, 8, 9])
    assert params["remote_num_tokens"] == 70 and params["remote_prompt_digest"] == prompt_digest(list(range(70)))
    assert params["remote_prompt_digest"] == _p_params(list(range(70)), [1, 2, 3])["remote_prompt_digest"]
    assert params["remote_prompt_digest"] != _p_params(list(range(69)) + [0], [7, 8, 9])["remote_prompt_digest"]


def test_d_loads_p_kv_for_a_prefix_of_its_prompt():
    prompt = list(range(64))
    params = _p_params(prompt, [7, 8])
    side = _d_side()
    d = request("d", prompt + [99], params)
    d.arrival_time -= 5.0  # vLLM's wall-clock arrival: D's worker is told how long it queued
    assert side.get_num_new_matched_tokens(d, 0) == (64, True)
    side.update_state_after_alloc(d, blocks([5, 6]), 64)
    meta = side.build_connector_meta(EMPTY)
    spec = meta.reqs_to_recv["d"]
    assert (spec.local_block_ids, spec.remote_block_ids, spec.tokens.first, spec.tokens.count) == ((5, 6), (7, 8), 0, 64)
    assert not meta.reqs_failed and spec.report
    assert 5.0 <= spec.queued_s < 60.0

    d2 = request("d2", prompt + [99], params)
    assert side.get_num_new_matched_tokens(d2, 32) == (32, True)
    side.update_state_after_alloc(d2, blocks([6], hits=[5]), 32)
    spec = side.build_connector_meta(EMPTY).reqs_to_recv["d2"]
    assert (spec.local_block_ids, spec.remote_block_ids, spec.tokens.first, spec.tokens.count) == ((6,), (8,), 32, 32)

    d3 = request("d3", prompt + [99], params)
    assert side.get_num_new_matched_tokens(d3, 64) == (0, False)


def test_d_refuses_p_kv_for_another_prompt():
    prompt = list(range(64))
    params = _p_params(prompt, [7, 8])
    cases = {
        "same length, other tokens": (list(range(1, 65)), params),
        "longer, other first tokens": ([5] + list(range(1, 64)) + [99], params),
        "shorter than P's prompt": (prompt[:40], params),
        "longer without the digest": (prompt + [99], {k: v for k, v in params.items() if k != "remote_prompt_digest"}),
        "a digest that is not one": (prompt, {**params, "remote_prompt_digest": 12}),
    }
    side = _d_side()
    for rid, (d_prompt, d_params) in cases.items():
        d = request(rid, d_prompt, d_params)
        count, load = side.get_num_new_matched_tokens(d, 0)
        assert load, rid
        side.update_state_after_alloc(d, blocks([5, 6][: -(-count // BLOCK)]), count)
    failed = side.build_connector_meta(EMPTY).reqs_failed
    assert set(failed) == set(cases), failed
    assert "differ" in failed["same length, other tokens"] and "differ" in failed["longer, other first tokens"]
    assert "remote_prompt_digest" in failed["longer without the digest"]
    assert "remote_prompt_digest" in failed["a digest that is not one"]


def test_the_prompt_digest_travels_to_both_workers_in_the_transfer_id_flow():
    prompt = list(range(64))
    p = _p_side()
    r = request("p-req", prompt, {"do_remote_decode": True, "transfer_id": "xfer-1"}, max_tokens=1)
    p.get_num_new_matched_tokens(r, 0)
    p.request_finished(finish(r, RequestStatus.FINISHED_LENGTH_CAPPED), [7, 8])
    sent = p.build_connector_meta(EMPTY).reqs_to_send["p-req"]
    tid = {"do_remote_prefill": True, "transfer_id": "xfer-1", "remote_host": "127.0.0.1", "remote_port": 7001}
    specs = {}
    for rid, d_prompt in {"same": prompt, "other": list(range(1, 65))}.items():
        d_side = _d_side()
        d = request(rid, d_prompt, tid)
        assert d_side.get_num_new_matched_tokens(d, 0) == (64, True)
        d_side.update_state_after_alloc(d, blocks([5, 6]), 64)
        specs[rid] = d_side.build_connector_meta(EMPTY).reqs_to_recv[rid]
    assert sent.key == "xfer-1" and sent.prompt_digest and specs["same"].remote_block_ids == ()
    assert specs["same"].prompt_digest == sent.prompt_digest != specs["other"].prompt_digest

    d_side = _d_side(mode="push")
    d = request("seeded", prompt + [99], _p_params(prompt, [7, 8]))
    d_side.get_num_new_matched_tokens(d, 0)
    d_side.update_state_after_alloc(d, blocks([5, 6]), 64)
    assert d_side.build_connector_meta(EMPTY).reqs_to_recv["seeded"].prompt_digest == sent.prompt_digest

    d_side = _d_side()
    d = request("cached", prompt, tid)
    assert d_side.get_num_new_matched_tokens(d, 64) == (0, False)
    d_side.update_state_after_alloc(d, blocks([], hits=[5, 6]), 0)
    release = d_side.build_connector_meta(EMPTY).reqs_to_recv["cached"]
    assert not release.report and release.prompt_digest == sent.prompt_digest


@pytest.mark.parametrize("flow", ["params", "transfer-id"])
def test_vllms_stand_in_for_a_request_that_failed_before_admission_releases_p(flow):
    """AsyncLLM.notify_kv_transfer_request_rejected (0.32 and 0.33): a Request with prompt [0] and
    abort_immediately, added (on_new_request) and aborted at once (request_finished). D tells P to
    free the blocks, stating no digest (the placeholder is not the prompt P's KV covers)."""
    prompt = list(range(64))
    if flow == "params":
        params, key = _p_params(prompt, [7, 8]), "p-req"
    else:
        params, key = {"do_remote_prefill": True, "transfer_id": "t-9", "remote_host": "127.0.0.1", "remote_port": 7001}, "t-9"
    side = _d_side()
    stand_in = rejected_stand_in("failed", params)
    assert stand_in.abort_immediately and stand_in.prompt_token_ids == [0] and stand_in.kv_transfer_params == params
    side.on_new_request(stand_in)
    assert side.request_finished(finish(stand_in, RequestStatus.FINISHED_ABORTED), []) == (False, None)
    meta = side.build_connector_meta(EMPTY)
    release = meta.reqs_to_recv["failed"]
    assert not release.report and release.prompt_digest == "" and release.remote_request_id == key
    assert not release.local_block_ids and not meta.reqs_failed


@pytest.mark.parametrize("flow", ["params", "transfer-id"])
def test_a_request_refused_while_the_engine_is_paused_releases_p(flow):
    """vLLM 0.33's paused engine (EngineCore._reject_add_while_paused) answers the client with an
    error, marks the real request abort_immediately and adds it only to abort it: P is told to
    free the blocks, and its release never states another prompt's digest."""
    prompt = list(range(64))
    if flow == "params":
        params, key = _p_params(prompt, [7, 8]), "p-req"
    else:
        params, key = {"do_remote_prefill": True, "transfer_id": "t-8", "remote_host": "127.0.0.1", "remote_port": 7001}, "t-8"
    side = _d_side()
    refused = paused_stand_in("paused", prompt, params)
    side.on_new_request(refused)
    assert side.request_finished(finish(refused, RequestStatus.FINISHED_ABORTED), []) == (False, None)
    release = side.build_connector_meta(EMPTY).reqs_to_recv["paused"]
    assert not release.report and release.remote_request_id == key
    assert release.prompt_digest in ("", prompt_digest(prompt))


def test_p_holds_blocks_of_a_finished_prefill_and_frees_an_aborted_one():
    p = _p_side()
    ok = request("ok", list(range(40)), {"do_remote_decode": True}, max_tokens=1)
    delay, params = p.request_finished(finish(ok, RequestStatus.FINISHED_LENGTH_CAPPED), [3, 4])
    assert delay and params is not None and params["remote_block_ids"] == [3, 4] and params["remote_num_tokens"] == 40
    gone = request("gone", list(range(40)), {"do_remote_decode": True, "transfer_id": "t-2"}, max_tokens=1)
    p.get_num_new_matched_tokens(gone, 0)
    assert p.request_finished(finish(gone, RequestStatus.FINISHED_ABORTED), [5, 6]) == (False, None)
    meta = p.build_connector_meta(EMPTY)
    assert set(meta.reqs_to_send) == {"ok"} and meta.reqs_to_send["ok"].block_ids == (3, 4)
    assert "t-2" in meta.transfers_cancelled


def test_layerwise_push_is_marked_from_vllms_new_request_data():
    """P, transfer-id flow: a prefill this step computes whole is listed for layer-wise writes (its
    blocks from NewRequestData.block_ids, its prompt's digest); a chunked one is not."""
    p = _p_side()
    prompt = list(range(64))
    whole = request("whole", prompt, {"do_remote_decode": True, "transfer_id": "t-w"}, max_tokens=1)
    chunked = request("chunked", list(range(96)), {"do_remote_decode": True, "transfer_id": "t-c"}, max_tokens=1)
    for r in (whole, chunked):
        p.get_num_new_matched_tokens(r, 0)
    meta = p.build_connector_meta(step((whole, [3, 4], 64), (chunked, [5, 6, 7], 64)))
    assert set(meta.reqs_layerwise) == {"whole"} and not meta.idle
    spec = meta.reqs_layerwise["whole"]
    assert spec.block_ids == (3, 4) and spec.key == "t-w" and spec.prompt_digest == prompt_digest(prompt)
    # Its prefill ended abnormally with layer-wise writes possibly in flight: the blocks are held.
    delay, params = p.request_finished(finish(whole, RequestStatus.FINISHED_ABORTED), [3, 4])
    assert delay and params is None and p.build_connector_meta(EMPTY).reqs_to_send["whole"].cancelled


def test_a_step_without_tokens_is_marked_idle_for_the_worker():
    side = _p_side()
    assert side.build_connector_meta(EMPTY).idle is True
    assert side.build_connector_meta(busy_step(3)).idle is False
