"""A model's cached layers as its Hugging Face `config.json` states them, by kind, and whether this
connector moves them: `kv-connectors check-config --model`, before any server starts. Pure (the
config's dict in, a report out).

vLLM gives each kind of cached layer one or more KV cache groups (its hybrid memory allocator);
start-up reads the groups vLLM made (`vllm/compat.cache_groups`) and stays the authority. This reads
the same facts from the config alone, with the same verdict: one kind of layer is one group and is
served; several kinds are served when each is full or sliding-window attention, and refused, naming
the kind and its layers, otherwise (a partial load would serve wrong answers)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kv_connectors.errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"  # Llama 4's local attention in fixed chunks
MAMBA = "mamba"
LINEAR = "linear_attention"  # Qwen3-Next's gated delta net and kin
SHORT_CONV = "short_conv"  # LFM2's convolution layers
MLA = "mla"  # DeepSeek's latent attention (one vector per token)
SLIDING_MLA = "sliding_window_mla"
SERVED_AMONG_SEVERAL = frozenset({FULL, SLIDING})

# A config's own names for a layer's kind (layer_types, layers_block_type), as the kinds above.
_ALIASES = {
    "full_attention": FULL,
    "attention": FULL,
    "global": FULL,
    "sliding_attention": SLIDING,
    "sliding_window": SLIDING,
    "local": SLIDING,
    "chunked_attention": CHUNKED,
    "mamba": MAMBA,
    "mamba2": MAMBA,
    "linear_attention": LINEAR,
    "conv": SHORT_CONV,
    "short_conv": SHORT_CONV,
}
# Nemotron-H's hybrid_override_pattern: a character per layer; "-" (MLP) and "E" (experts) cache nothing.
_PATTERN = {"M": MAMBA, "*": FULL}


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """The layers of one kind: `window` is a sliding window's or a chunk's length in tokens (0: none)."""

    kind: str
    layers: tuple[int, ...]
    window: int = 0

    def describe(self) -> str:
        extent = f" (window {self.window})" if self.kind in (SLIDING, SLIDING_MLA) and self.window else ""
        extent = f" (chunk {self.window})" if self.kind == CHUNKED and self.window else extent
        return f"{self.kind}{extent}: {len(self.layers)} layer{'s' * (len(self.layers) != 1)} ({_ranges(self.layers)})"


@dataclasses.dataclass(frozen=True)
class ModelGroups:
    """A model's cached layers by kind, in order of first layer, and why they are refused ('' if served)."""

    architecture: str
    kinds: tuple[LayerKind, ...]
    refusal: str = ""

    @property
    def served(self) -> bool:
        return not self.refusal

    @property
    def hybrid(self) -> bool:
        return len(self.kinds) > 1

    def describe(self) -> str:
        verdict = "served" if self.served else f"refused: {self.refusal}"
        head = f"{self.architecture}, {'hybrid, ' if self.hybrid else ''}{verdict}"
        return head + "".join(f"\n  {k.describe()}" for k in self.kinds)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelGroups:
        """as_dict()'s inverse (the doctor's report keeps the dict)."""
        kinds = tuple(LayerKind(k["kind"], tuple(k["layers"]), k["window"] or 0) for k in d["kinds"])
        return cls(d["architecture"], kinds, d["refusal"] or "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "served": self.served,
            "refusal": self.refusal or None,
            "kinds": [{"kind": k.kind, "layers": list(k.layers), "window": k.window or None} for k in self.kinds],
        }


def read_config(path: str | Path) -> dict[str, Any]:
    """A model's config.json (given the file or the model's directory); a ConfigError naming the path otherwise."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the model's config {file}: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"the model's config {file} is not a JSON object")
    return config


def model_groups(config: Mapping[str, Any]) -> ModelGroups:
    """What `config` (a config.json's dict; a multimodal model's text_config is read) says of its
    cached layers, and the verdict start-up will give."""
    architecture = ",".join(config.get("architectures") or []) or str(config.get("model_type", "unknown"))
    text = {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else dict(config)
    per_layer = _kinds_per_layer(text)
    if text.get("kv_lora_rank"):  # MLA caches the latent in its attention layers
        per_layer = [(i, {FULL: MLA, SLIDING: SLIDING_MLA}.get(k, k)) for i, k in per_layer]
    window = text.get("sliding_window") or 0
    windows = {SLIDING: window, SLIDING_MLA: window, CHUNKED: text.get("attention_chunk_size") or 0}
    by_kind: dict[str, list[int]] = {}
    for i, kind in per_layer:
        by_kind.setdefault(kind, []).append(i)
    kinds = tuple(LayerKind(kind, tuple(layers), int(windows.get(kind, 0))) for kind, layers in by_kind.items())
    return ModelGroups(architecture, kinds, _refusal(kinds))


def _kinds_per_layer(c: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(layer index, kind) of every cached layer; a layer holding two kinds (Falcon-H1) is named twice."""
    n = _int(c.get("num_hidden_layers"), "num_hidden_layers")
    model_type = str(c.get("model_type", ""))
    kinds: list[str]
    if isinstance(c.get("layer_types"), list):
        kinds = [_ALIASES.get(str(t), str(t)) for t in _exactly(c["layer_types"], n, "layer_types")]
    elif isinstance(c.get("layers_block_type"), list):  # Jamba, Granite 4 hybrids
        kinds = [_ALIASES.get(str(t), str(t)) for t in _exactly(c["layers_block_type"], n, "layers_block_type")]
    elif isinstance(c.get("hybrid_override_pattern"), str):  # Nemotron-H: MLP and expert layers cache nothing
        pattern = _exactly(list(c["hybrid_override_pattern"]), n, "hybrid_override_pattern")
        return [(i, _PATTERN[ch]) for i, ch in enumerate(pattern) if ch in _PATTERN]
    elif model_type.startswith("falcon_h1"):  # each layer holds attention and a Mamba mixer side by side
        return [(i, FULL) for i in range(n)] + [(i, MAMBA) for i in range(n)]
    elif c.get("full_attention_interval"):  # Qwen3-Next: every interval-th layer full, the others linear
        every = _int(c["full_attention_interval"], "full_attention_interval")
        kinds = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
    elif c.get("attention_chunk_size"):  # Llama 4: layers with RoPE attend in chunks, the NoPE ones globally
        every = _int(c.get("no_rope_layer_interval") or 4, "no_rope_layer_interval")
        rope = c.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
        kinds = [CHUNKED if use_rope else FULL for use_rope in _exactly(list(rope), n, "no_rope_layers")]
    elif model_type == "gemma2" and c.get("sliding_window"):  # even layers local
        kinds = [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    elif model_type.startswith("gemma3") and c.get("sliding_window"):  # every pattern-th layer global
        every = _int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6, "sliding_window_pattern")
        kinds = [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]
    elif c.get("sliding_window") and c.get("use_sliding_window", True):  # Mistral-style: every layer
        kinds = [SLIDING] * n
    else:
        kinds = [FULL] * n
    return list(enumerate(kinds))


def _refusal(kinds: Sequence[LayerKind]) -> str:
    """Mirrors vllm/compat.cache_groups: one kind is one group and is served; among several, each must be
    full or sliding-window attention."""
    if len(kinds) <= 1:
        return ""
    for k in kinds:
        if k.kind not in SERVED_AMONG_SEVERAL:
            where = "in a model of several KV cache groups" if k.kind in (MLA, SLIDING_MLA) else "beside other kinds"
            return (
                f"{k.kind} layers ({_ranges(k.layers)}) {where} are not supported yet; moving the other groups "
                "alone would serve wrong answers, so an instance of this model does not start"
            )
    return ""


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"the model's config has no usable {key} ({value!r})")
    return value


def _exactly(values: list[Any], n: int, key: str) -> list[Any]:
    if len(values) != n:
        raise ConfigError(f"the model's config lists {len(values)} {key} for {n} layers")
    return values


def _ranges(layers: Sequence[int]) -> str:
    """0,1,2,5 -> 'layers 0-2, 5'."""
    parts: list[str] = []
    start = prev = None
    for i in layers:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = i
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(parts)
