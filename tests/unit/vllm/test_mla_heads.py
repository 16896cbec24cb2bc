"""MLA in the adapter: an MLA model (DeepSeek-V2/V3 and kin) caches one latent per token
(kv_lora_rank + qk_rope_head_dim values, no head dimension), the same on every tensor-parallel rank.
Its config's num_key_value_heads (128 for DeepSeek-V3) is not what the cache holds: the adapter
counts one KV head, so each rank's blocks get token-major cells (CUDA and CPU alike) and a decode
rank reads the latent from one prefill rank. Against stand-ins for vLLM's config objects."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kv_connectors.errors import ConfigError
from kv_connectors.layout import TensorInfo, token_major
from kv_connectors.tp import reader_count, source_ranks
from kv_connectors.vllm import compat
from kv_connectors.vllm.connector import kv_cells

CONFIG_KV_HEADS = 128  # DeepSeek-V3's num_key_value_heads
LATENT = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
BLOCKS, BLOCK_SIZE, BF16 = 10, 16, 2


def _vllm_config(use_mla: bool, tp: int = 1, head_size: int = LATENT) -> Any:
    mc = SimpleNamespace(
        use_mla=use_mla,
        hf_config=SimpleNamespace(architectures=["DeepseekV3ForCausalLM"]),
        hf_text_config=SimpleNamespace(num_hidden_layers=2),
        get_total_num_hidden_layers=lambda: 2,
        get_hidden_size=lambda: 7168,
        get_total_num_kv_heads=lambda: CONFIG_KV_HEADS,
        get_head_size=lambda: head_size,
        get_vocab_size=lambda: 129280,
        dtype="bfloat16",
    )
    return SimpleNamespace(
        model_config=mc,
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK_SIZE),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, rank=0),
    )


def _latent_tensor() -> TensorInfo:
    """One MLA layer as vLLM allocates it: (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)."""
    return TensorInfo("layers.0.self_attn.attn", 0, (BLOCKS, BLOCK_SIZE, LATENT), (BLOCK_SIZE * LATENT, LATENT, 1), BF16)


def test_an_mla_model_has_one_kv_head_whatever_its_config_says() -> None:
    assert compat.model_facts(_vllm_config(use_mla=True))["num_kv_heads"] == 1
    assert compat.model_facts(_vllm_config(use_mla=False, head_size=128))["num_kv_heads"] == CONFIG_KV_HEADS


@pytest.mark.parametrize("on_cpu", [False, True], ids=["cuda", "cpu"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_holds_the_whole_latent_token_by_token(tp: int, on_cpu: bool) -> None:
    """CUDA's MLA backends and vLLM's CPU MLA backend share the latent's layout (the CPU one views
    it as (-1, 576)): token-major cells on every rank, never vLLM's CPU K/V layout."""
    cfg = _vllm_config(use_mla=True, tp=tp)
    heads = compat.model_facts(cfg)["num_kv_heads"]
    latent = token_major(heads=1, head_stride=0, tokens=BLOCK_SIZE, token_stride=LATENT * BF16, cell_bytes=LATENT * BF16)
    for rank in range(tp):
        assert kv_cells(cfg, _latent_tensor(), BLOCKS, heads, rank, on_cpu) == latent


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 2), (2, 4), (1, 8), (4, 8)])
def test_a_decode_rank_reads_the_replicated_latent_from_one_prefill_rank(p_tp: int, d_tp: int) -> None:
    heads = compat.model_facts(_vllm_config(use_mla=True, tp=d_tp))["num_kv_heads"]
    sources = [source_ranks(heads, p_tp, d_tp, r) for r in range(d_tp)]
    assert sources == [[r % p_tp] for r in range(d_tp)]  # one copy each, spread over P's ranks
    assert [reader_count(heads, p_tp, d_tp, p) for p in range(p_tp)] == [d_tp // p_tp] * p_tp


def test_a_prefill_with_more_ranks_than_the_decode_is_refused() -> None:
    """P TP 2 -> D TP 1: D reads P rank 0's copy; P rank 1 would hold its blocks until its lease ran out."""
    heads = compat.model_facts(_vllm_config(use_mla=True))["num_kv_heads"]
    assert source_ranks(heads, 2, 1, 0) == [0]
    with pytest.raises(ConfigError, match="prefill rank 1's KV would never be read"):
        reader_count(heads, 2, 1, 0)
