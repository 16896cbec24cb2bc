"""Hybrid models (several KV cache groups: a sliding window beside full attention) through vLLM's own
Scheduler and KV cache manager (tests/unit/vllm/vllm_objects.py): P states each group's blocks that hold
KV, D loads each group's from its tail, vLLM's null blocks are never named on either side; what cannot
be served is refused at start-up (a group kind we do not move) or per request (P's window no longer
holds what D needs, a block size of another)."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from kv_connectors.errors import ConfigError
from kv_connectors.groups import NULL_BLOCK
from tests.unit.vllm.vllm_objects import BLOCK, HYBRID_WINDOW, model_output, request, scheduler

HYBRID = ("sliding", "full")
PROMPT = list(range(4, 204))  # 200 tokens: 7 blocks, the window (64 tokens) the last 3 of them


def _prefill(p, rid: str = "p-1", prompt: list[int] = PROMPT) -> dict:
    """P computes the prompt (in as many steps as its token budget takes) and samples one token."""
    p.add_request(request(rid, prompt, {"do_remote_decode": True}, max_tokens=1, hashed=True))
    while True:
        out = p.schedule()
        done = p.requests[rid].num_computed_tokens >= len(prompt)  # schedule() counts the step's tokens in
        outputs = p.update_from_output(out, model_output({rid: 7 if done else None}))
        if done:
            (answer,) = outputs[0].outputs
            return answer.kv_transfer_params


def _loaded(d, rid: str, params: dict, prompt: list[int] = PROMPT):
    d.add_request(request(rid, prompt, params, max_tokens=3, hashed=True))
    return d.schedule()


def test_p_states_each_group_and_d_loads_each_from_its_tail():
    p = scheduler("kv_producer", groups=HYBRID)
    params = _prefill(p)
    sliding, full = params["remote_block_ids"]
    p_tables = p.kv_cache_manager.get_block_ids("p-1")
    assert full == p_tables[1] and len(full) == 7
    assert sliding == [b for b in p_tables[0] if b != NULL_BLOCK] and NULL_BLOCK not in sliding
    held = p.schedule().kv_connector_metadata.reqs_to_send["p-1"].block_ids  # P's lease: every group's blocks
    assert held == (*sliding, *full)

    d = scheduler("kv_consumer", groups=HYBRID)
    step = _loaded(d, "d-1", params)
    spec = step.kv_connector_metadata.reqs_to_recv["d-1"]
    d_sliding, d_full = d.kv_cache_manager.get_block_ids("d-1")
    window_blocks = [b for b in d_sliding if b != NULL_BLOCK]
    assert NULL_BLOCK in d_sliding and len(window_blocks) <= HYBRID_WINDOW // BLOCK + 1  # vLLM skips the rest
    assert spec.local_block_ids == (*window_blocks, *d_full) and NULL_BLOCK not in spec.local_block_ids
    assert spec.remote_block_ids == (*sliding[len(sliding) - len(window_blocks) :], *full)

    d.update_from_output(step, model_output(finished_recving={"d-1"}))  # D's worker loaded them
    step = d.schedule()
    assert step.num_scheduled_tokens == {"d-1": 1}, "D computes only the last prompt token"
    p.update_from_output(p.schedule(), model_output(finished_sending={"p-1"}))
    assert p.kv_cache_manager.usage == 0 and not p.requests


def test_a_chunked_prefill_states_only_the_window_it_kept():
    """P computing the prompt in chunks drops its sliding window's earlier blocks as it goes (null in
    vLLM's table): its params name the blocks it kept, and D's load pairs with those."""
    p = scheduler("kv_producer", groups=HYBRID, chunk_tokens=64)
    params = _prefill(p)
    sliding, full = params["remote_block_ids"]
    assert NULL_BLOCK in p.kv_cache_manager.get_block_ids("p-1")[0] and NULL_BLOCK not in sliding
    d = scheduler("kv_consumer", groups=HYBRID)
    spec = _loaded(d, "d-1", params).kv_connector_metadata.reqs_to_recv["d-1"]
    n_window = len([b for b in d.kv_cache_manager.get_block_ids("d-1")[0] if b != NULL_BLOCK])
    assert spec.remote_block_ids == (*sliding[-n_window:], *full)


def test_d_prefix_hits_in_both_groups_load_only_the_rest():
    p = scheduler("kv_producer", groups=HYBRID)
    d = scheduler("kv_consumer", groups=HYBRID)
    first = _loaded(d, "d-0", _prefill(p, "p-0"))  # D gets the prompt once, and caches it
    d.update_from_output(first, model_output(finished_recving={"d-0"}))
    d.update_from_output(d.schedule(), model_output({"d-0": 9}))
    d.finish_requests(["d-0"], RequestStatus.FINISHED_ABORTED)
    longer = [*PROMPT, *range(300, 340)]  # 240 tokens: D holds the first 200 already
    params = _prefill(p, "p-1", longer)
    spec = _loaded(d, "d-1", params, longer).kv_connector_metadata.reqs_to_recv.get("d-1")
    assert spec is not None and spec.tokens.first > 0, "D's own prefix hits were not used"
    d_sliding, d_full = d.kv_cache_manager.get_block_ids("d-1")
    hits = spec.tokens.first // BLOCK
    assert spec.local_block_ids[-len(d_full[hits:]) :] == tuple(d_full[hits:])
    assert NULL_BLOCK not in spec.local_block_ids and len(spec.local_block_ids) == len(spec.remote_block_ids)


def test_a_window_p_no_longer_holds_fails_the_load_and_frees_p():
    params = _prefill(scheduler("kv_producer", groups=HYBRID))
    sliding, full = params["remote_block_ids"]
    d = scheduler("kv_consumer", groups=HYBRID)
    meta = _loaded(d, "d-1", {**params, "remote_block_ids": [sliding[-1:], full]}).kv_connector_metadata
    assert "group 0" in meta.reqs_failed["d-1"] and "holds 1 blocks" in meta.reqs_failed["d-1"]
    assert not meta.reqs_to_recv["d-1"].report  # P told to free its blocks, nothing read


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"remote_block_size": 64}, "same block size"),
        ({"remote_block_ids": [1, 2, 3]}, "1 KV cache group"),
    ],
)
def test_loads_a_hybrid_cannot_take_fail_naming_why(change, why):
    params = {**_prefill(scheduler("kv_producer", groups=HYBRID)), **change}
    params = {k: v for k, v in params.items() if v is not None}
    meta = _loaded(scheduler("kv_consumer", groups=HYBRID), "d-1", params).kv_connector_metadata
    assert why in meta.reqs_failed["d-1"], meta.reqs_failed


def test_a_one_group_model_refuses_per_group_params():
    params = {**_prefill(scheduler("kv_producer")), "remote_block_ids": [[1, 2], [3, 4, 5, 6, 7, 8, 9]]}
    meta = _loaded(scheduler("kv_consumer"), "d-1", params).kv_connector_metadata
    assert "2 KV cache groups; this model has one" in meta.reqs_failed["d-1"]


def test_a_group_kind_we_do_not_move_stops_start_up_naming_it():
    with pytest.raises(ConfigError, match=r"KV cache group 0 of 2 \(MambaSpec, layers model.layers.0"):
        scheduler("kv_consumer", groups=("mamba", "full"))


def test_push_states_each_groups_blocks_on_both_sides():
    """D pushing: its load names its blocks group by group (the push request carries the sizes), and P's
    lease holds its own group by group: P pairs them when it writes."""
    p = scheduler("kv_producer", groups=HYBRID)
    params = _prefill(p)
    send = p.schedule().kv_connector_metadata.reqs_to_send["p-1"]
    assert send.group_sizes == tuple(len(g) for g in params["remote_block_ids"])
    d = scheduler("kv_consumer", {"mode": "push"}, groups=HYBRID)
    spec = _loaded(d, "d-1", params).kv_connector_metadata.reqs_to_recv["d-1"]
    d_sliding, d_full = d.kv_cache_manager.get_block_ids("d-1")
    window = [b for b in d_sliding if b != NULL_BLOCK]
    assert spec.group_sizes == (len(window), len(d_full)) and spec.local_block_ids == (*window, *d_full)


def test_the_transfer_id_flow_names_ds_blocks_group_by_group_for_p_to_pair():
    d = scheduler("kv_consumer", groups=HYBRID)
    params = {"do_remote_prefill": True, "transfer_id": "t-1", "remote_host": "127.0.0.1", "remote_port": 7001}
    meta = _loaded(d, "d-1", params).kv_connector_metadata
    spec = meta.reqs_to_recv["d-1"]
    d_sliding, d_full = d.kv_cache_manager.get_block_ids("d-1")
    window = [b for b in d_sliding if b != NULL_BLOCK]
    assert not meta.reqs_failed and spec.remote_block_ids == ()
    assert spec.local_block_ids == (*window, *d_full) and spec.group_sizes == (len(window), len(d_full))


def test_p_does_not_mark_layerwise_writes_for_a_hybrid():
    p = scheduler("kv_producer", groups=HYBRID)
    p.add_request(request("w", PROMPT, {"do_remote_decode": True, "transfer_id": "t-w"}, max_tokens=1, hashed=True))
    assert not p.schedule().kv_connector_metadata.reqs_layerwise


def test_a_model_of_one_sliding_window_group_never_reads_vllms_null_blocks():
    """All layers sliding (one group): P's params name its table as vLLM gives it, positions kept (a D of
    another block size maps tokens through it), null blocks and all; D loads only its window, from the tail."""
    p = scheduler("kv_producer", groups=("sliding",))
    params = _prefill(p)
    assert params["remote_block_ids"] == p.kv_cache_manager.get_block_ids("p-1")[0]
    assert NULL_BLOCK in params["remote_block_ids"]
    d = scheduler("kv_consumer", groups=("sliding",))
    spec = _loaded(d, "d-1", params).kv_connector_metadata.reqs_to_recv["d-1"]
    window = tuple(b for b in d.kv_cache_manager.get_block_ids("d-1")[0] if b != NULL_BLOCK)
    assert spec.local_block_ids == window and spec.remote_block_ids == tuple(params["remote_block_ids"][-len(window) :])
    assert NULL_BLOCK not in spec.remote_block_ids
