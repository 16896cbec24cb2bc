"""vLLM's own Scheduler calling our connector (tests/unit/vllm/vllm_objects.py builds it as the engine core
does, with the tiny model's config): the hooks in the order and with the objects vLLM passes, P's
hand-off and D's load step by step, the stand-ins vLLM sends to free P's blocks, layer-wise
marking of prefills the scheduler computes whole. `make test-vllm-next` runs this file on vLLM
0.33's sources, whose scheduler calls the hooks from changed code."""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kv_connectors.params import prompt_digest
from tests.unit.vllm.vllm_objects import BLOCK, model_output, paused_stand_in, rejected_stand_in, request, scheduler

PROMPT = list(range(4, 84))  # 80 tokens: two full blocks and a partial one


def _prefill(p, rid: str = "p-1", params: dict | None = None) -> dict:
    """P computes the prompt and samples its one token; returns what vLLM answers the client with."""
    p.add_request(request(rid, PROMPT, params or {"do_remote_decode": True}, max_tokens=1, hashed=True))
    out = p.schedule()
    assert out.num_scheduled_tokens == {rid: len(PROMPT)}
    outputs = p.update_from_output(out, model_output({rid: 7}))
    (answer,) = outputs[0].outputs
    assert answer.finish_reason is not None
    return answer.kv_transfer_params


def test_p_hands_off_its_blocks_and_d_loads_them_through_vllms_scheduler():
    p = scheduler("kv_producer")
    params = _prefill(p)
    blocks = params["remote_block_ids"]
    assert len(blocks) == 3 and params["remote_num_tokens"] == len(PROMPT) and params["remote_request_id"] == "p-1"
    assert params["remote_prompt_digest"] == prompt_digest(PROMPT) and params["remote_block_size"] == BLOCK
    step = p.schedule()  # the finished prefill's blocks go to P's worker, held for D
    assert step.kv_connector_metadata.reqs_to_send["p-1"].block_ids == tuple(blocks)
    assert p.kv_cache_manager.usage > 0, "P freed the blocks before D had them"

    d = scheduler("kv_consumer")
    d.add_request(request("d-1", PROMPT, params, max_tokens=3, hashed=True))
    step = d.schedule()
    assert d.requests["d-1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS and not step.num_scheduled_tokens
    spec = step.kv_connector_metadata.reqs_to_recv["d-1"]
    assert list(spec.local_block_ids) == d.kv_cache_manager.get_block_ids("d-1")[0]
    assert list(spec.remote_block_ids) == blocks and (spec.tokens.first, spec.tokens.count) == (0, len(PROMPT))

    d.update_from_output(step, model_output(finished_recving={"d-1"}))  # D's worker loaded it
    step = d.schedule()
    assert step.num_scheduled_tokens == {"d-1": 1}, "D computes only the last prompt token"
    assert [r.num_computed_tokens for r in step.scheduled_new_reqs] == [len(PROMPT) - 1]
    (answer,) = d.update_from_output(step, model_output({"d-1": 9}))[0].outputs
    assert answer.new_token_ids == [9]

    p.update_from_output(p.schedule(), model_output(finished_sending={"p-1"}))  # D noticed: P frees
    assert p.kv_cache_manager.usage == 0 and not p.requests


def test_a_failed_load_is_vllms_to_handle():
    """Our worker reports a failed load in finished_recving and failed_recving: vLLM then fails the
    request (kv_load_failure_policy "fail", its default) instead of decoding from missing KV."""
    p = scheduler("kv_producer")
    d = scheduler("kv_consumer")
    d.add_request(request("d-2", PROMPT, _prefill(p), max_tokens=3, hashed=True))
    step = d.schedule()
    (answer,) = d.update_from_output(step, model_output(finished_recving={"d-2"}, failed_recving={"d-2"}))[0].outputs
    assert answer.request_id == "d-2" and answer.finish_reason == FinishReason.ERROR and not answer.new_token_ids
    assert not d.schedule().num_scheduled_tokens and "d-2" not in d.requests and d.kv_cache_manager.usage == 0


@pytest.mark.parametrize("kind", ["rejected", "paused"])
@pytest.mark.parametrize("flow", ["params", "transfer-id"])
def test_vllms_stand_ins_free_p_blocks_through_the_scheduler(kind, flow):
    """What the engine core does with both stand-ins: add_request, then abort_requests (0.32 and
    0.33: a request rejected before admission, prompt [0]; 0.33: a request refused while paused,
    its own prompt). D's worker is told to release P's blocks, no digest of the placeholder."""
    if flow == "params":
        params, key = _prefill(scheduler("kv_producer")), "p-1"
    else:
        params, key = {"do_remote_prefill": True, "transfer_id": "t-5", "remote_host": "127.0.0.1", "remote_port": 7001}, "t-5"
    d = scheduler("kv_consumer")
    stand_in = rejected_stand_in("gone", params) if kind == "rejected" else paused_stand_in("gone", PROMPT, params)
    d.add_request(stand_in)
    d.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    release = d.schedule().kv_connector_metadata.reqs_to_recv["gone"]
    assert not release.report and release.remote_request_id == key and not release.local_block_ids
    assert release.prompt_digest in ("", prompt_digest(PROMPT)) and (kind == "paused" or release.prompt_digest == "")
    assert d.kv_cache_manager.usage == 0


def test_layerwise_push_is_marked_for_prefills_vllm_computes_whole():
    """P, transfer-id flow: the step that computes a prompt whole lists it for layer-wise writes
    (the blocks vLLM allocated); a prefill vLLM chunks is pushed whole once it finishes."""
    p = scheduler("kv_producer")
    p.add_request(request("w", PROMPT, {"do_remote_decode": True, "transfer_id": "t-w"}, max_tokens=1, hashed=True))
    spec = p.schedule().kv_connector_metadata.reqs_layerwise["w"]
    assert list(spec.block_ids) == p.kv_cache_manager.get_block_ids("w")[0] and spec.key == "t-w"

    chunked = scheduler("kv_producer", chunk_tokens=64)
    chunked.add_request(request("c", PROMPT, {"do_remote_decode": True, "transfer_id": "t-c"}, max_tokens=1, hashed=True))
    step = chunked.schedule()
    assert step.num_scheduled_tokens == {"c": 64} and not step.kv_connector_metadata.reqs_layerwise
    chunked.update_from_output(step, model_output({"c": None}))  # a chunk samples nothing
    step = chunked.schedule()
    assert step.num_scheduled_tokens == {"c": len(PROMPT) - 64} and not step.kv_connector_metadata.reqs_layerwise
    (answer,) = chunked.update_from_output(step, model_output({"c": 7}))[0].outputs
    assert answer.kv_transfer_params["transfer_id"] == "t-c"
    assert chunked.schedule().kv_connector_metadata.reqs_to_send["c"].key == "t-c"
