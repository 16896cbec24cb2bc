"""Our kv_transfer_params carry every key vLLM's built-in NixlConnector's carry, with the same meaning,
so that routers and frameworks that read or copy them in NIXL mode (vllm-router --kv-connector nixl,
SMG's vLLM NIXL flow, llm-d's nixlv2 sidecar, Dynamo) work unchanged. Both P's answers are produced by
vLLM's own Scheduler (tests/unit/vllm/vllm_objects.py), once with the built-in (`"kv_connector":
"NixlConnector"`, no module path) and once with ours (the module-path form): the params flow (P asked
with do_remote_decode) and the transfer-id flow (also a transfer_id). Our D takes the built-in's
answer as it takes ours."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager

from kv_connectors.params import parse_remote_prefill
from tests.unit.vllm import vllm_objects
from tests.unit.vllm.vllm_objects import BLOCK, MAX_MODEL_LEN, NUM_BLOCKS, TINY_LLAMA, model_output, request

PROMPT = list(range(4, 84))  # 80 tokens: three blocks of 32
ENGINE = "p-engine-0"
HOST, PORT = "10.1.2.3", 5757


def _scheduler(kv: KVTransferConfig) -> Scheduler:
    """vLLM's Scheduler with this kv_transfer_config (vllm_objects.scheduler's, any connector)."""
    cfg = VllmConfig(
        model_config=vllm_objects._model_config(),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=MAX_MODEL_LEN, max_num_seqs=8, max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False
        ),
        kv_transfer_config=kv,
    )
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(TINY_LLAMA["num_hidden_layers"])]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    groups = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return Scheduler(cfg, groups, StructuredOutputManager(cfg), block_size=BLOCK, log_stats=False)


def _config(ours: bool, extra: dict[str, Any] | None = None, transport: str = "nixl") -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=vllm_objects.CONNECTOR_NAMES[transport],
        kv_connector_module_path=vllm_objects.MODULE_FORMS[transport] if ours else None,
        kv_role="kv_producer",
        engine_id=ENGINE,
        kv_connector_extra_config=dict(extra or {}),
    )


def _answer(
    ours: bool, params: dict[str, Any], rid: str = "p-1", extra: dict[str, Any] | None = None, transport: str = "nixl"
) -> dict[str, Any]:
    """P's kv_transfer_params for a one-token prefill of PROMPT, as vLLM's engine core returns them and
    as they reach a router (JSON)."""
    p = _scheduler(_config(ours, extra, transport))
    assert type(p.connector).__module__.startswith("kv_connectors" if ours else "vllm."), type(p.connector)
    p.add_request(request(rid, PROMPT, params, max_tokens=1, hashed=True))
    out = p.schedule()
    (answer,) = p.update_from_output(out, model_output({rid: 7}))[0].outputs
    assert answer.finish_reason is not None and answer.kv_transfer_params, answer
    return json.loads(json.dumps(answer.kv_transfer_params))


@pytest.fixture(scope="module", autouse=True)
def _side_channel_env():
    """Both connectors advertise the side channel these (the built-in's) variables name."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", HOST)
        mp.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(PORT))
        yield


@pytest.fixture(scope="module")
def builtin() -> dict[str, Any]:
    return _answer(False, {"do_remote_decode": True})


def _flat(block_ids: Any) -> list[int]:
    """The built-in states block ids per KV cache group ([[...]]); ours, one group, flat."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        (group,) = block_ids
        return list(group)
    return list(block_ids)


FLOWS = {
    "params": {"do_remote_decode": True},
    "transfer-id": {"do_remote_decode": True, "transfer_id": "t-42"},
}


@pytest.mark.parametrize("flow", FLOWS)
def test_our_answer_carries_every_key_of_the_builtins(builtin: dict[str, Any], flow: str) -> None:
    ours = _answer(True, FLOWS[flow])
    missing = sorted(set(builtin) - set(ours))
    assert not missing, f"our P's kv_transfer_params ({flow} flow) lack the built-in's {missing}: {ours}"


@pytest.mark.parametrize("flow", FLOWS)
def test_each_key_means_what_the_builtins_does(builtin: dict[str, Any], flow: str) -> None:
    ours = _answer(True, FLOWS[flow])
    # What D does with the answer: load the prompt from P (a P-side answer never asks D to hand off).
    assert (ours["do_remote_prefill"], ours["do_remote_decode"]) == (builtin["do_remote_prefill"], builtin["do_remote_decode"])
    assert (ours["do_remote_prefill"], ours["do_remote_decode"]) == (True, False)
    # Where P's KV is: P's engine, P's side channel (the built-in's variables name it for both), P's TP size.
    for key in ("remote_engine_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size"):
        assert ours[key] == builtin[key], (key, ours[key], builtin[key])
    assert (ours["remote_engine_id"], ours["remote_host"], ours["remote_port"]) == (ENGINE, HOST, PORT)
    # Which blocks, how many tokens: the prompt's, in P's blocks.
    assert _flat(ours["remote_block_ids"]) == _flat(builtin["remote_block_ids"]) and len(_flat(ours["remote_block_ids"])) == 3
    assert ours["remote_num_tokens"] == builtin["remote_num_tokens"] == len(PROMPT)
    # The key P holds the blocks under: P's request id (the transfer id where the request had one).
    assert builtin["remote_request_id"] == "p-1"
    assert ours["remote_request_id"] == ("t-42" if flow == "transfer-id" else "p-1")
    # D reads P's blocks (pull); no D-side readback deadline on a P answer.
    assert ours["transfer_mode"] == builtin["transfer_mode"] == "pull"
    assert ours["remote_blocks_expiry_time"] is builtin["remote_blocks_expiry_time"] is None
    # Types as the built-in's, for routers that decode them into typed structs (SMG, Dynamo).
    for key, value in builtin.items():
        if value is not None and key != "remote_block_ids":
            assert type(ours[key]) is type(value), (key, ours[key], value)


@pytest.mark.parametrize(("transport", "extra"), [("nixl", {"mode": "push"}), ("mooncake", {})])
def test_a_p_configured_to_push_answers_pull_shaped(transport: str, extra: dict[str, Any]) -> None:
    """vllm-router reads transfer_mode: for "push" it sends D the built-in push connector's shape (P's
    engine and side channel, its own X-Request-Id as remote_request_id, no block ids), which our D
    cannot load from; seen behind vllm-router 0.1.17 with our MooncakeConnector (push by default).
    Our P's answer always holds the blocks for D and names them, and D's config decides who moves the
    bytes: "pull" whatever P's mode."""
    ours = _answer(True, {"do_remote_decode": True}, extra=extra, transport=transport)
    assert ours["transfer_mode"] == "pull" and len(ours["remote_block_ids"]) == 3, ours


def test_our_d_takes_the_builtins_answer(builtin: dict[str, Any]) -> None:
    """A router that got its params from a built-in P (or made them in that shape) works with our D."""
    remote = parse_remote_prefill(builtin)  # its block ids per KV cache group: [[...]]
    assert remote.remote_block_ids == tuple(_flat(builtin["remote_block_ids"]))
    assert (remote.remote_engine_id, remote.remote_host, remote.remote_port) == (ENGINE, HOST, PORT)
    assert remote.remote_tp_size == builtin["tp_size"] and remote.remote_num_tokens == len(PROMPT)
