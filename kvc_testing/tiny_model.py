"""Build deterministic random-weights Llama models plus a BPE tokenizer locally, cached on disk."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

# Bump when anything in the recipe (text, tokenizer, config, weights) changes: cached dirs rebuild.
RECIPE_VERSION = "v1"
MARKER_FILE = "kv_connectors_model.json"
CACHE_ENV = "KV_CONNECTORS_CACHE"

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

MAX_POSITION_EMBEDDINGS = 2048
# Architecture of each variant; everything else (vocab, rope, norms) is shared. `positions` (max
# position embeddings) defaults to MAX_POSITION_EMBEDDINGS; a variant that sets it fits longer prompts.
VARIANTS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=256),
    "base": dict(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536),
    # Benchmark sizes (bench_e2e.py --model-size): KV large enough for its transfer to matter.
    # small: ~88 MB of float32 weights, 32 KiB of KV per token; medium: ~346 MB, 72 KiB per token.
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=8, head_dim=64, intermediate=1024, positions=4096),
    "medium": dict(hidden=768, layers=12, heads=12, kv_heads=12, head_dim=64, intermediate=2048, positions=4096),
}
# What bench_e2e.py --model-size offers, smallest first.
MODEL_SIZES = ("tiny", "small", "medium")
INIT_STD = 0.02
# At std 0.02 a random Llama's greedy output is near-constant (PLATFORM.md); x4 makes it vary.
INIT_SCALE = 4.0

_WORDS = (
    "the of and to in is was for on that with as by at from it an be this are or his her which "
    "had not but were their they one all has have been more when there who would will can if "
    "about into time only other some new first after also two over such then than many most "
    "these may any where out made people could through well world before state year during "
    "cache block token layer prefill decode transfer remote engine request memory server queue "
    "kernel tensor vector matrix head batch stream socket buffer offset length stride shape "
    "python model vllm llama attention key value hidden weight scale random seed greedy sample "
    "river mountain forest ocean city village garden window door table chair paper letter book "
    "red green blue yellow black white bright dark quick slow small large long short warm cold "
    "run walk read write open close start stop send receive build test check measure compare "
    "monday tuesday friday morning evening night summer winter spring autumn north south east west"
).split()
_PUNCT = (".", ".", ".", ",", "!", "?", ";", ":")


def default_cache_dir() -> Path:
    """`$KV_CONNECTORS_CACHE` if set, else `~/.cache/kv_connectors/models` (read at call time)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kv_connectors" / "models"


def training_text(seed: int = 0, n_lines: int = 6000) -> list[str]:
    """Deterministic pseudo-English lines (words, numbers, code-ish bits) for tokenizer training."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 4096)))
        if rng.random() < 0.15:
            words.append(f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}({rng.randint(0, 99)})")
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice(_PUNCT)
        lines.append(line if i % 7 else f"# {line}")
    return lines


def max_positions(variant: str) -> int:
    """The longest sequence (prompt + output) a variant's config allows."""
    return VARIANTS[variant].get("positions", MAX_POSITION_EMBEDDINGS)


def weight_bytes(variant: str) -> int:
    """Bytes of the variant's float32 weights (what model.safetensors holds, without its header)."""
    a = VARIANTS[variant]
    h, q_out, kv_out = a["hidden"], a["heads"] * a["head_dim"], a["kv_heads"] * a["head_dim"]
    per_layer = 2 * h + 2 * q_out * h + 2 * kv_out * h + 3 * a["intermediate"] * h
    return 4 * (2 * VOCAB_SIZE * h + h + a["layers"] * per_layer)


def kv_bytes_per_token(variant: str, dtype_bytes: int = 4) -> int:
    """KV cache bytes one token takes over all layers (K and V)."""
    a = VARIANTS[variant]
    return a["layers"] * 2 * a["kv_heads"] * a["head_dim"] * dtype_bytes


def _build_tokenizer(out_dir: Path, seed: int, positions: int = MAX_POSITION_EMBEDDINGS) -> None:
    """Train a byte-level BPE of VOCAB_SIZE on local text; write tokenizer.json + config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocab is {tok.get_vocab_size()}, wanted {VOCAB_SIZE}")
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": positions,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out_dir / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": "<unk>"},
    )


def _model_config(arch: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": arch["hidden"],
        "intermediate_size": arch["intermediate"],
        "num_hidden_layers": arch["layers"],
        "num_attention_heads": arch["heads"],
        "num_key_value_heads": arch["kv_heads"],
        "head_dim": arch["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": arch.get("positions", MAX_POSITION_EMBEDDINGS),
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "use_cache": True,
        "torch_dtype": "float32",
    }


def _random_weights(arch: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    """HF Llama state dict, float32, N(0, INIT_STD * INIT_SCALE) from a seeded CPU generator."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    std = INIT_STD * INIT_SCALE
    h, inter = arch["hidden"], arch["intermediate"]
    q_out, kv_out = arch["heads"] * arch["head_dim"], arch["kv_heads"] * arch["head_dim"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, h)}
    for i in range(arch["layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(h)
        sd[p + "self_attn.q_proj.weight"] = normal(q_out, h)
        sd[p + "self_attn.k_proj.weight"] = normal(kv_out, h)
        sd[p + "self_attn.v_proj.weight"] = normal(kv_out, h)
        sd[p + "self_attn.o_proj.weight"] = normal(h, q_out)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
        sd[p + "mlp.gate_proj.weight"] = normal(inter, h)
        sd[p + "mlp.up_proj.weight"] = normal(inter, h)
        sd[p + "mlp.down_proj.weight"] = normal(h, inter)
    sd["model.norm.weight"] = torch.ones(h)
    sd["lm_head.weight"] = normal(VOCAB_SIZE, h)
    return sd


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _digest(model_dir: Path) -> str:
    """sha256 over the model's files (excluding the marker), stable across runs."""
    h = hashlib.sha256()
    for f in sorted(model_dir.iterdir()):
        if f.name != MARKER_FILE and f.is_file():
            h.update(f.name.encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _build_once(final: Path, is_valid: Callable[[dict[str, Any]], bool], build: Callable[[Path], None]) -> Path:
    """Build `final` via `build(tmp)` + atomic rename unless a valid copy exists.

    A per-target flock serialises concurrent builders (two pytest processes); the rename means
    readers never see a half-written dir.
    """
    marker = _read_marker(final)
    if marker is not None and is_valid(marker):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            marker = _read_marker(final)
            if marker is not None and is_valid(marker):
                return final
            tmp = Path(tempfile.mkdtemp(prefix=f".build-{final.name}-", dir=final.parent))
            try:
                build(tmp)
                for f in tmp.iterdir():
                    f.chmod(0o644)
                tmp.chmod(0o755)  # mkdtemp makes 0700; the cache may be shared
                if final.exists():  # stale or incomplete: move away first, then delete
                    trash = Path(tempfile.mkdtemp(prefix=".stale-", dir=final.parent))
                    os.rename(final, trash / final.name)
                    shutil.rmtree(trash, ignore_errors=True)
                os.rename(tmp, final)
                logger.info("built %s", final)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def build_tiny_model(cache_dir: str | Path | None = None, *, variant: str = "tiny", seed: int = 0) -> Path:
    """Return a dir loadable by vLLM (`--model DIR`) and transformers; built once per recipe.

    The dir name encodes variant, seed and RECIPE_VERSION; see `_build_once` for concurrency.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / f"llama-{variant}-seed{seed}-{RECIPE_VERSION}"
    arch = VARIANTS[variant]

    def build(tmp: Path) -> None:
        _write_json(tmp / "config.json", _model_config(arch))
        _write_json(
            tmp / "generation_config.json",
            {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "do_sample": False},
        )
        _build_tokenizer(tmp, seed, max_positions(variant))
        save_file(_random_weights(arch, seed), str(tmp / "model.safetensors"))
        info = {"recipe": RECIPE_VERSION, "variant": variant, "seed": seed, "arch": arch}
        _write_json(tmp / MARKER_FILE, {**info, "digest": _digest(tmp)})

    return _build_once(final, lambda m: m.get("recipe") == RECIPE_VERSION, build)


def perturb_kv_weights(model_dir: str | Path, out_dir: str | Path | None = None, scale: float = 0.5, seed: int = 1) -> Path:
    """Copy `model_dir` with k_proj/v_proj weights perturbed by `scale` x their std of noise.

    config.json and the tokenizer are byte-identical to the source, so anything hashed from
    the config matches, while KV computed by this model differs. Cached by source digest.
    """
    src = Path(model_dir)
    src_marker = _read_marker(src)
    src_digest = src_marker["digest"] if src_marker else _digest(src)
    final = Path(out_dir) if out_dir is not None else src.parent / f"{src.name}-kvperturb{scale:g}"
    wanted = {"source_digest": src_digest, "scale": scale, "perturb_seed": seed}

    def build(tmp: Path) -> None:
        for f in src.iterdir():
            if f.is_file() and f.name != MARKER_FILE and f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        n_changed = 0
        for shard in sorted(src.glob("*.safetensors")):
            sd = load_file(str(shard))
            for name in sorted(sd):
                if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                    w = sd[name]
                    noise = torch.randn(w.shape, generator=gen, dtype=w.dtype)
                    sd[name] = (w + noise * (scale * w.std())).contiguous()
                    n_changed += 1
            save_file(sd, str(tmp / shard.name))
        if n_changed == 0:
            raise RuntimeError(f"no k_proj/v_proj weights found in {src}")
        info = {"recipe": RECIPE_VERSION, "source": str(src), "perturbed_tensors": n_changed}
        _write_json(tmp / MARKER_FILE, {**info, **wanted, "digest": _digest(tmp)})

    return _build_once(final, lambda m: all(m.get(k) == v for k, v in wanted.items()), build)
