"""vLLM's own scheduler-side objects, built as vLLM's engine core and scheduler build them, for the
adapter tests (tests/unit/vllm/test_vllm_*.py; `make test-vllm-next` runs them on vLLM 0.33's sources):
`Request` from `SamplingParams(extra_args={"kv_transfer_params": ...})`, both stand-ins vLLM sends
only to run `request_finished` (`abort_immediately`), `KVCacheBlocks` of `KVCacheBlock`s (prefix
hits carry a block hash, null blocks are vLLM's), a `SchedulerOutput` with `NewRequestData`, a
`VllmConfig` with the compilation config a GPU platform would leave, and vLLM's own `Scheduler`
(the tiny model's config, no weights) calling our connector's scheduler side."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm.config import CacheConfig, CompilationConfig, CUDAGraphMode, KVTransferConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.request import Request, RequestStatus

BLOCK = 32
MODULE_FORMS = {"nixl": "kv_connectors.nixl", "mooncake": "kv_connectors.mooncake"}
CONNECTOR_NAMES = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}


def request(
    rid: str,
    prompt: Sequence[int] | None,
    params: Mapping[str, Any] | None,
    *,
    max_tokens: int = 8,
    abort_immediately: bool = False,
    hashed: bool = False,
) -> Request:
    """A request as vLLM's engine core makes it from an API request (EngineCoreRequest ->
    Request.from_engine_core_request): kv_transfer_params travel in the sampling params' extra_args.
    hashed: its full blocks hashed as the engine core hashes them (prefix caching; a scheduler's)."""
    extra = {"kv_transfer_params": dict(params)} if params is not None else None
    core = EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=list(prompt) if prompt is not None else None,
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        abort_immediately=abort_immediately,
    )
    hasher = None
    if hashed:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        hasher = get_request_block_hasher(BLOCK, sha256)
    return Request.from_engine_core_request(core, block_hasher=hasher)


def rejected_stand_in(rid: str, params: Mapping[str, Any]) -> Request:
    """vLLM's stand-in for a request that failed before admission (AsyncLLM.notify_kv_transfer_
    request_rejected, 0.32 and 0.33): prompt [0], one token, abort_immediately, the params."""
    return request(rid, [0], params, max_tokens=1, abort_immediately=True)


def paused_stand_in(rid: str, prompt: Sequence[int], params: Mapping[str, Any]) -> Request:
    """vLLM 0.33's second kind (EngineCore._reject_add_while_paused): the real request, its real
    prompt, marked abort_immediately after it was built and added again only to be aborted."""
    req = request(rid, prompt, params)
    req.abort_immediately = True
    return req


def finish(req: Request, status: RequestStatus) -> Request:
    """What vLLM's scheduler sets before it calls request_finished."""
    req.status = status
    return req


def blocks(new: Sequence[int], hits: Sequence[int] = (), nulls: int = 0) -> KVCacheBlocks:
    """A one-group allocation as KVCacheManager returns it: `nulls` null blocks (vLLM's block 0, as
    a sliding window leaves them), then the prefix-cache hits (hashed), then the new blocks."""
    null = [KVCacheBlock(0, is_null=True) for _ in range(nulls)]
    cached = []
    for i, b in enumerate(hits):
        block = KVCacheBlock(b)
        block.set_block_hash(make_block_hash_with_group_id(BlockHash(i.to_bytes(8, "little")), 0))
        cached.append(block)
    return KVCacheBlocks(([*null, *cached, *[KVCacheBlock(b) for b in new]],))


def step(*scheduled: tuple[Request, Sequence[int], int]) -> SchedulerOutput:
    """A SchedulerOutput scheduling new requests: (request, its block ids, tokens this step)."""
    out = SchedulerOutput.make_empty()
    new = [NewRequestData.from_request(req, (list(block_ids),)) for req, block_ids, _n in scheduled]
    counts = {req.request_id: n for req, _b, n in scheduled}
    return dataclasses.replace(
        out, scheduled_new_reqs=new, num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values())
    )


def busy_step(tokens: int = 1) -> SchedulerOutput:
    """A step that computes tokens of requests already running (none new)."""
    return dataclasses.replace(
        SchedulerOutput.make_empty(), num_scheduled_tokens={"other": tokens}, total_num_scheduled_tokens=tokens
    )


@functools.cache
def _base_config() -> VllmConfig:
    return VllmConfig(cache_config=CacheConfig(block_size=BLOCK))


def vllm_config(
    role: str,
    extra: Mapping[str, Any] | None = None,
    *,
    transport: str = "nixl",
    cudagraph_mode: CUDAGraphMode | None = None,
) -> VllmConfig:
    """A VllmConfig naming our connector in the README's module-path form. With cudagraph_mode, the
    compilation config a CUDA platform leaves (this CPU platform turns CUDA graphs off when it
    builds a VllmConfig, so the compilation config is set afterwards)."""
    cfg = copy.copy(_base_config())
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAMES[transport],
        kv_connector_module_path=MODULE_FORMS[transport],
        kv_role=role,
        kv_connector_extra_config=dict(extra or {}),
    )
    if cudagraph_mode is not None:
        cfg.compilation_config = CompilationConfig(cudagraph_mode=cudagraph_mode)
    return cfg


# vLLM's own scheduler, calling our connector's scheduler-side hooks ------------------------------
TINY_LLAMA = {  # kvc_testing.tiny_model's architecture: a config is all vLLM's scheduler reads
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
MAX_MODEL_LEN = 512
NUM_BLOCKS = 64


@functools.cache
def _model_config() -> Any:
    from vllm.config import ModelConfig

    folder = Path(tempfile.mkdtemp(prefix="kvc-tiny-config-"))
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0)


HYBRID_WINDOW = 64  # kvc_testing.hybrid_model's sliding window, in tokens


def kv_cache_groups(kinds: Sequence[str] = ("full",)) -> list[Any]:
    """KV cache groups as vLLM makes them: one per kind ("full", "sliding": a window of HYBRID_WINDOW
    tokens, "mamba"), two layers each, layer i of every group overlaying the same tensor (HMA)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

    attn = dict(num_kv_heads=2, head_size=32, dtype=torch.float32)
    groups = []
    for g, kind in enumerate(kinds):
        layers = [f"model.layers.{g + len(kinds) * i}.self_attn.attn" for i in range(2)]
        if kind == "full":
            spec: Any = FullAttentionSpec(block_size=BLOCK, **attn)
        elif kind == "sliding":
            spec = SlidingWindowSpec(block_size=BLOCK, sliding_window=HYBRID_WINDOW, **attn)
        else:
            spec = MambaSpec(block_size=BLOCK, shapes=((4, 64),), dtypes=(torch.float32,))
        groups.append(KVCacheGroupSpec(layers, spec))
    return groups


def scheduler(
    role: str,
    extra: Mapping[str, Any] | None = None,
    *,
    transport: str = "nixl",
    chunk_tokens: int = 0,
    groups: Sequence[str] = ("full",),
) -> Any:
    """vLLM's Scheduler as the engine core builds it, with our connector from the module-path form
    (scheduler.connector) and a KV cache of NUM_BLOCKS blocks in `groups` (kv_cache_groups: one full
    attention group unless said); chunk_tokens: a token budget per step that chunks longer prefills."""
    from vllm.config import SchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    budget = chunk_tokens or MAX_MODEL_LEN
    sched = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=bool(chunk_tokens),
        is_encoder_decoder=False,
    )
    cfg = VllmConfig(
        model_config=_model_config(),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=sched,
        kv_transfer_config=vllm_config(role, extra, transport=transport).kv_transfer_config,
    )
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine core sets from the workers' memory
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups(groups))
    return Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=BLOCK, log_stats=False)


def model_output(sampled: Mapping[str, int | None] | None = None, **kv_connector_output: Any) -> Any:
    """What the workers answer a step with: the token each scheduled request sampled (None: none,
    a prefill chunk), and what our worker side reported (finished_sending, finished_recving,
    failed_recving)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    sampled = dict(sampled or {})
    return ModelRunnerOutput(
        req_ids=list(sampled),
        req_id_to_index={rid: i for i, rid in enumerate(sampled)},
        sampled_token_ids=[[] if t is None else [t] for t in sampled.values()],
        kv_connector_output=KVConnectorOutput(**kv_connector_output) if kv_connector_output else None,
    )
