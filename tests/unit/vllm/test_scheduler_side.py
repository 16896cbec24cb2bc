"""D's scheduler side, driven with stand-ins for vLLM's request objects: heartbeats for requests
waiting in D's queue start after lease_renew_after_s and stop when the request leaves the queue."""

from __future__ import annotations

from types import SimpleNamespace

from kv_connectors.config import parse_config
from kv_connectors.vllm.compat import RequestStatus
from kv_connectors.vllm.scheduler import SchedulerSide
from tests.unit.engine.engine_harness import FakeClock

BLOCK = 32
OUTPUT = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})


def _request(rid: str, key: str, n_tokens: int = 64) -> SimpleNamespace:
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2],
        "remote_engine_id": "P",
        "remote_request_id": key,
        "remote_host": "127.0.0.1",
        "remote_port": 7001,
        "remote_num_tokens": n_tokens,
    }
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        prompt_token_ids=list(range(n_tokens)),
        num_prompt_tokens=n_tokens,
        status=RequestStatus.WAITING,
    )


def _blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None) for b in ids]])


def test_queued_requests_get_heartbeats_until_scheduled_or_finished():
    clock = FakeClock()
    side = SchedulerSide(parse_config("D", "kv_consumer", {"lease_renew_after_s": 1.0}), BLOCK, 7002, clock=clock)
    a, b, c = _request("a", "ka"), _request("b", "kb"), _request("c", "kc")
    side.on_new_request(a)
    side.on_new_request(b)
    clock.advance(0.5)
    side.on_new_request(c)
    assert not side.build_connector_meta(OUTPUT).renew_start, "a request scheduled at once needs no heartbeat"
    clock.advance(0.6)  # a and b queued 1.1 s, c 0.6 s
    meta = side.build_connector_meta(OUTPUT)
    assert meta.renew_start == {"a": (("P", "127.0.0.1", 7001), "ka", None), "b": (("P", "127.0.0.1", 7001), "kb", None)}
    # a is scheduled: its load starts and its heartbeats stop in the same step.
    assert side.get_num_new_matched_tokens(a, 0) == (64, True)
    side.update_state_after_alloc(a, _blocks([5, 6]), 64)
    # b is aborted while queued.
    b.status = RequestStatus.FINISHED_ABORTED
    side.request_finished(b, [])
    meta = side.build_connector_meta(OUTPUT)
    assert meta.renew_stop == {"a", "b"} and "a" in meta.reqs_to_recv
    clock.advance(1.0)
    assert set(side.build_connector_meta(OUTPUT).renew_start) == {"c"}


def test_requests_without_remote_prefill_are_not_tracked():
    clock = FakeClock()
    side = SchedulerSide(parse_config("D", "kv_consumer", {}), BLOCK, 7002, clock=clock)
    side.on_new_request(SimpleNamespace(request_id="x", kv_transfer_params=None))
    bad = _request("y", "ky")
    bad.kv_transfer_params = {"do_remote_prefill": True, "remote_block_ids": "nope"}
    side.on_new_request(bad)
    clock.advance(10)
    assert not side.build_connector_meta(OUTPUT).renew_start


def test_params_are_parsed_once_per_request_and_forgotten_when_it_finishes(monkeypatch):
    import kv_connectors.vllm.scheduler as scheduler

    calls: list[object] = []
    parse = scheduler.parse_request_params

    def counting(params):
        calls.append(params)
        return parse(params)

    monkeypatch.setattr(scheduler, "parse_request_params", counting)
    side = SchedulerSide(parse_config("D", "kv_consumer", {}), BLOCK, 7002, clock=FakeClock())
    a = _request("a", "ka")
    side.on_new_request(a)
    assert side.get_num_new_matched_tokens(a, 0) == (64, True)
    assert side.get_num_new_matched_tokens(a, 0) == (64, True)
    side.update_state_after_alloc(a, _blocks([5, 6]), 64)
    a.status = RequestStatus.FINISHED_STOPPED
    assert side.request_finished(a, [5, 6]) == (False, None)
    assert len(calls) == 1 and "a" in side.build_connector_meta(OUTPUT).reqs_to_recv
    assert not side._params, "a finished request's params are kept"

    # P: the transfer id of a do_remote_decode request, parsed once, returned in P's params
    p = SchedulerSide(parse_config("P", "kv_producer", {}), BLOCK, 7001, clock=FakeClock())
    r = _request("r", "")
    r.kv_transfer_params = {"do_remote_decode": True, "transfer_id": "t-1"}
    calls.clear()
    assert p.get_num_new_matched_tokens(r, 0) == (0, False)
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.request_finished(r, [3, 4])
    assert delay and params is not None and params["remote_request_id"] == "t-1" and params["transfer_id"] == "t-1"
    assert len(calls) == 1 and not p._params


def test_the_prefills_tp_size_travels_from_p_to_d_workers():
    """P's params state its TP size; D's scheduler hands it to its workers (each reads from the P
    ranks holding its heads) for loads, releases and heartbeats."""
    clock = FakeClock()
    side = SchedulerSide(parse_config("D", "kv_consumer", {"lease_renew_after_s": 1.0}), BLOCK, 7002, clock=clock, tp_size=2)
    a, b, q = _request("a", "ka"), _request("b", "kb"), _request("q", "kq")
    for r in (a, b, q):
        r.kv_transfer_params["tp_size"] = 1
        side.on_new_request(r)
    clock.advance(2.0)
    assert side.build_connector_meta(OUTPUT).renew_start["q"][2] == 1
    side.get_num_new_matched_tokens(a, 0)
    side.update_state_after_alloc(a, _blocks([5, 6]), 64)
    side.get_num_new_matched_tokens(b, 64)
    side.update_state_after_alloc(b, _blocks([]), 0)  # every block a local hit: a release
    meta = side.build_connector_meta(OUTPUT)
    assert meta.reqs_to_recv["a"].remote_tp_size == 1 and meta.reqs_to_recv["a"].report
    assert meta.reqs_to_recv["b"].remote_tp_size == 1 and not meta.reqs_to_recv["b"].report

    p = SchedulerSide(parse_config("P", "kv_producer", {}), BLOCK, 7001, clock=FakeClock(), tp_size=2)
    r = _request("r", "")
    r.kv_transfer_params = {"do_remote_decode": True}
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.request_finished(r, [3, 4])[1]["tp_size"] == 2


def test_a_prefill_with_another_block_size_loads_the_tokens_d_lacks():
    """P's params state its block size (16 tokens) and D's blocks hold 32: P's block count is
    checked against P's size, and a D prefix hit of 32 tokens skips P's first two blocks."""
    side = SchedulerSide(parse_config("D", "kv_consumer", {}), BLOCK, 7002, clock=FakeClock())
    a = _request("a", "ka", n_tokens=64)
    a.kv_transfer_params |= {"remote_block_ids": [11, 12, 13, 14], "remote_block_size": 16}
    assert side.get_num_new_matched_tokens(a, 32) == (32, True)
    blocks = SimpleNamespace(blocks=[[SimpleNamespace(block_id=1, block_hash=b"h"), SimpleNamespace(block_id=9, block_hash=None)]])
    side.update_state_after_alloc(a, blocks, 32)
    spec = side.build_connector_meta(OUTPUT).reqs_to_recv["a"]
    assert spec.local_block_ids == (9,) and spec.remote_block_ids == (13, 14)
    assert (spec.tokens.first, spec.tokens.count, spec.tokens.dst_start, spec.tokens.src_start) == (32, 32, 32, 32)

    b = _request("b", "kb", n_tokens=64)
    b.kv_transfer_params |= {"remote_block_ids": [11, 12, 13], "remote_block_size": 16}  # 64 tokens fill 4
    side.get_num_new_matched_tokens(b, 0)
    side.update_state_after_alloc(b, _blocks([5, 6]), 64)
    assert "remote_block_ids has 3 blocks, the prompt fills 4" in side.build_connector_meta(OUTPUT).reqs_failed["b"]


def _p_params(prompt: list[int], block_ids: list[int]) -> dict:
    """What P's scheduler side returns for a finished prefill of `prompt`."""
    p = SchedulerSide(parse_config("P", "kv_producer", {}), BLOCK, 7001, clock=FakeClock())
    r = SimpleNamespace(
        request_id="p-req",
        kv_transfer_params={"do_remote_decode": True},
        prompt_token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
    )
    p.get_num_new_matched_tokens(r, 0)
    delay, params = p.request_finished(r, block_ids)
    assert delay and params is not None
    return params


def _d_request(rid: str, prompt: list[int], params: dict) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        prompt_token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        status=RequestStatus.WAITING,
    )


def test_p_states_a_digest_of_its_prompt():
    params = _p_params(list(range(70)), [7, 8, 9])
    assert params["remote_num_tokens"] == 70 and isinstance(params["remote_prompt_digest"], str)
    assert params["remote_prompt_digest"] == _p_params(list(range(70)), [1, 2, 3])["remote_prompt_digest"]
    assert params["remote_prompt_digest"] != _p_params(list(range(69)) + [0], [7, 8, 9])["remote_prompt_digest"]


def test_d_loads_p_kv_for_a_prefix_of_its_prompt():
    """First token from prefill: D's prompt is P's plus the token P sampled; D loads P's 64 tokens and
    computes the 65th itself (P's blocks cover 64 tokens: 2 blocks; D allocated 2 for them)."""
    prompt = list(range(64))
    params = _p_params(prompt, [7, 8])
    side = SchedulerSide(parse_config("D", "kv_consumer", {}), BLOCK, 7002, clock=FakeClock())
    d = _d_request("d", prompt + [99], params)
    assert side.get_num_new_matched_tokens(d, 0) == (64, True)
    side.update_state_after_alloc(d, _blocks([5, 6]), 64)
    spec = side.build_connector_meta(OUTPUT).reqs_to_recv["d"]
    assert (spec.local_block_ids, spec.remote_block_ids) == ((5, 6), (7, 8))
    assert (spec.tokens.first, spec.tokens.count) == (0, 64)
    assert not side.build_connector_meta(OUTPUT).reqs_failed

    # with 32 tokens already cached on D: the second block only
    d2 = _d_request("d2", prompt + [99], params)
    assert side.get_num_new_matched_tokens(d2, 32) == (32, True)
    side.update_state_after_alloc(d2, _blocks([6]), 32)
    spec = side.build_connector_meta(OUTPUT).reqs_to_recv["d2"]
    assert (spec.local_block_ids, spec.remote_block_ids, spec.tokens.first, spec.tokens.count) == ((6,), (8,), 32, 32)

    # D has cached all 64: nothing to load, P is told to free its blocks
    d3 = _d_request("d3", prompt + [99], params)
    assert side.get_num_new_matched_tokens(d3, 64) == (0, False)


def test_d_refuses_p_kv_for_another_prompt():
    """P's digest is checked against D's prompt: a D request whose first tokens are not P's prompt (of
    any length) fails instead of decoding from another prompt's KV; shorter remote KV needs the digest."""
    prompt = list(range(64))
    params = _p_params(prompt, [7, 8])
    cases = {
        "same length, other tokens": (list(range(1, 65)), params),
        "longer, other first tokens": ([5] + list(range(1, 64)) + [99], params),
        "shorter than P's prompt": (prompt[:40], params),
        "longer without the digest": (prompt + [99], {k: v for k, v in params.items() if k != "remote_prompt_digest"}),
        "a digest that is not one": (prompt, {**params, "remote_prompt_digest": 12}),
    }
    side = SchedulerSide(parse_config("D", "kv_consumer", {}), BLOCK, 7002, clock=FakeClock())
    for rid, (d_prompt, d_params) in cases.items():
        d = _d_request(rid, d_prompt, d_params)
        count, load = side.get_num_new_matched_tokens(d, 0)
        assert load, rid  # failed through the worker, which tells P to free its blocks
        side.update_state_after_alloc(d, _blocks([5, 6][: -(-count // BLOCK)]), count)
    failed = side.build_connector_meta(OUTPUT).reqs_failed
    assert set(failed) == set(cases), failed
    assert "differ" in failed["same length, other tokens"] and "differ" in failed["longer, other first tokens"]
    assert "remote_prompt_digest" in failed["longer without the digest"]
    assert "remote_prompt_digest" in failed["a digest that is not one"]


def test_the_prompt_digest_travels_to_both_workers_in_the_transfer_id_flow():
    """P's send spec and D's receive spec carry a digest of the prompt (D's: of the tokens P's KV is
    to cover), so that P can refuse to push a prompt's KV into a D request for another (an id
    reused by a router); equal prompts give equal digests, others differ."""
    prompt = list(range(64))
    p = SchedulerSide(parse_config("P", "kv_producer", {}), BLOCK, 7001, clock=FakeClock())
    r = SimpleNamespace(
        request_id="p-req",
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "xfer-1"},
        prompt_token_ids=prompt,
        num_prompt_tokens=64,
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
    )
    p.get_num_new_matched_tokens(r, 0)
    p.request_finished(r, [7, 8])
    sent = p.build_connector_meta(OUTPUT).reqs_to_send["p-req"]
    tid = {"do_remote_prefill": True, "transfer_id": "xfer-1", "remote_host": "127.0.0.1", "remote_port": 7001}
    specs = {}
    for rid, d_prompt in {"same": prompt, "other": list(range(1, 65))}.items():
        d_side = SchedulerSide(parse_config("D", "kv_consumer", {}), BLOCK, 7002, clock=FakeClock())
        d = _d_request(rid, d_prompt, dict(tid))
        assert d_side.get_num_new_matched_tokens(d, 0) == (64, True)
        d_side.update_state_after_alloc(d, _blocks([5, 6]), 64)
        specs[rid] = d_side.build_connector_meta(OUTPUT).reqs_to_recv[rid]
    assert sent.key == "xfer-1" and sent.prompt_digest and specs["same"].remote_block_ids == ()
    assert specs["same"].prompt_digest == sent.prompt_digest != specs["other"].prompt_digest

    # First token from prefill (request-id flow): D's prompt is P's plus a token; D states the digest
    # of the 64 tokens P's KV covers, P's own prompt's.
    d_side = SchedulerSide(parse_config("D", "kv_consumer", {"mode": "push"}), BLOCK, 7002, clock=FakeClock())
    d = _d_request("seeded", prompt + [99], _p_params(prompt, [7, 8]))
    d_side.get_num_new_matched_tokens(d, 0)
    d_side.update_state_after_alloc(d, _blocks([5, 6]), 64)
    assert d_side.build_connector_meta(OUTPUT).reqs_to_recv["seeded"].prompt_digest == sent.prompt_digest

    # Every token a local hit on D: only a release, which states the digest too (P ignores a
    # release for another prompt).
    d_side = SchedulerSide(parse_config("D", "kv_consumer", {}), BLOCK, 7002, clock=FakeClock())
    d = _d_request("cached", prompt, dict(tid))
    assert d_side.get_num_new_matched_tokens(d, 64) == (0, False)
    d_side.update_state_after_alloc(d, _blocks([]), 0)
    release = d_side.build_connector_meta(OUTPUT).reqs_to_recv["cached"]
    assert not release.report and release.prompt_digest == sent.prompt_digest


def test_vllms_stand_in_for_a_request_that_failed_before_admission_releases_without_a_digest():
    """vLLM frees P's blocks for a D request that failed before admission with a stand-in request
    (`abort_immediately`, prompt [0]) carrying its kv_transfer_params: its release must not state the
    placeholder prompt's digest, or P would keep the blocks until lease expiry."""
    params = _p_params(list(range(64)), [7, 8])
    side = SchedulerSide(parse_config("D", "kv_consumer", {}), BLOCK, 7002, clock=FakeClock())
    stand_in = _d_request("failed", [0], params)
    stand_in.abort_immediately = True
    stand_in.status = RequestStatus.FINISHED_ABORTED
    side.request_finished(stand_in, [])
    release = side.build_connector_meta(OUTPUT).reqs_to_recv["failed"]
    assert not release.report and release.prompt_digest == ""


def test_a_step_without_tokens_is_marked_idle_for_the_worker():
    side = SchedulerSide(parse_config("P", "kv_producer", {}), BLOCK, 7002)
    empty = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    busy = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={"x": 3}, total_num_scheduled_tokens=3)
    assert side.build_connector_meta(empty).idle is True
    assert side.build_connector_meta(busy).idle is False
    assert side.build_connector_meta(OUTPUT).idle is False, "a step of unknown size is not idle"
