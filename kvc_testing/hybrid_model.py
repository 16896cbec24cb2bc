"""Tiny random-weights hybrid-attention models (several KV cache groups in vLLM), built locally and cached.

Two families users deploy: Gemma 3 (sliding-window and global layers alternating) and gpt-oss
(sliding-window and full layers, attention sinks, a mixture of experts). Built with transformers'
own classes from a small config, weights scaled like the tiny Llama's so that greedy output varies,
the tiny Llama's tokenizer beside them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvc_testing.tiny_model import (
    MARKER_FILE,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    _build_once,
    _build_tokenizer,
    _digest,
    _write_json,
    default_cache_dir,
)

HYBRID_RECIPE = "h1"
# Weights' std: at the tiny Llama's 0.08 a random Gemma 3 repeats two tokens for ever; at 0.2 the 12 greedy
# tokens of each of four prompts were 10-12 distinct ones (both families, transformers on CPU).
INIT_STD = 0.2
MAX_POSITIONS = 2048
# Sliding window of every family, in tokens: shorter than the e2e prompts (up to ~300 tokens), so that a
# long prompt has blocks outside the window on both sides.
SLIDING_WINDOW = 64
_SHARED = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=MAX_POSITIONS,
    sliding_window=SLIDING_WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    bos_token_id=SPECIAL_TOKENS.index("<s>"),
    eos_token_id=SPECIAL_TOKENS.index("</s>"),
    pad_token_id=SPECIAL_TOKENS.index("<pad>"),
    initializer_range=INIT_STD,
    tie_word_embeddings=False,
)
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3": dict(_SHARED, query_pre_attn_scalar=32),
    "gpt_oss": dict(_SHARED, num_local_experts=4, num_experts_per_tok=2),  # yarn rope as its default (vLLM reads it)
}


def _model(family: str, seed: int) -> Any:
    """The transformers model of `family`, random weights from `seed` (CPU, float32)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM

    config_cls, model_cls = {"gemma3": (Gemma3TextConfig, Gemma3ForCausalLM), "gpt_oss": (GptOssConfig, GptOssForCausalLM)}[family]
    config = config_cls(**FAMILIES[family])
    config.torch_dtype = "float32"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():  # every matrix, sink and bias drawn at INIT_STD; norms as initialized
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith(("sinks", "bias")):
                p.normal_(0.0, INIT_STD)
    return model


def build_hybrid_model(family: str, cache_dir: str | Path | None = None, *, seed: int = 0) -> Path:
    """A dir vLLM serves (`--model DIR`) with two KV cache groups (sliding window and full attention)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown hybrid family {family!r}; known: {sorted(FAMILIES)}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / f"{family}-tiny-seed{seed}-{HYBRID_RECIPE}"

    def build(tmp: Path) -> None:
        _model(family, seed).save_pretrained(str(tmp), safe_serialization=True)
        _write_json(
            tmp / "generation_config.json",
            {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "do_sample": False},
        )
        _build_tokenizer(tmp, seed, MAX_POSITIONS)
        info = {"recipe": HYBRID_RECIPE, "family": family, "seed": seed, "sliding_window": SLIDING_WINDOW}
        _write_json(tmp / MARKER_FILE, {**info, "digest": _digest(tmp)})

    return _build_once(final, lambda m: m.get("recipe") == HYBRID_RECIPE, build)
