"""The vLLM-facing connector class: one KVConnectorBase_V1 that delegates to its scheduler or worker side."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from kv_connectors import affinity, config
from kv_connectors.config import ConnectorConfig, parse_config
from kv_connectors.errors import ConfigError
from kv_connectors.groups import CacheGroups
from kv_connectors.layout import (
    Cells,
    TensorInfo,
    build_layout,
    cells_of_cpu_tensor,
    cells_of_tensor,
    layer_regions,
)
from kv_connectors.logutil import RateLimitedLog
from kv_connectors.tp import rank_heads
from kv_connectors.transports import create_transport
from kv_connectors.transports.base import MemoryKind, Transport
from kv_connectors.vllm import compat, device
from kv_connectors.vllm.metadata import ConnectorMetadata
from kv_connectors.vllm.scheduler import SchedulerSide
from kv_connectors.vllm.stats import KvcPromMetrics, KvcStats
from kv_connectors.vllm.worker import WorkerSide
from kv_connectors.wire import CompatInfo

logger = logging.getLogger(__name__)
_limited = RateLimitedLog(logger)


def _in_forward_step(default: Callable[[], Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """No exception leaves a hook vLLM calls in its forward step (the worker process would die and
    the instance stop serving). The engine fails the affected requests itself; this is the last
    line: log (rate-limited) and carry on with `default()`."""

    def wrap(hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return hook(self, *args, **kwargs)
            except Exception:
                _limited.exception(hook.__name__, "KV connector hook %s failed", hook.__name__)
                return default()

        return guarded

    return wrap


def check_parallelism(parallel_config: Any, connector: str) -> None:
    """vLLM's parallel config through config.check_parallelism (the check `kv-connectors check-config` runs)."""
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    config.check_parallelism(tp, pp, connector)


def tensor_info(name: str, t: torch.Tensor) -> TensorInfo:
    return TensorInfo(name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())


def kv_cells(vllm_config: Any, info: TensorInfo, num_blocks: int, total_heads: int, rank: int, on_cpu: bool) -> Cells | None:
    """A rank's tokens and heads inside a block (for the planner), or None where the tensor does not
    tell them apart: then only whole blocks are planned. vLLM's CPU attention keeps K and V in a
    layout its shape does not tell; MLA's latent is token-major on CPU (cpu_mla) and CUDA alike."""
    tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    block_size = int(vllm_config.cache_config.block_size)
    try:
        first, heads = rank_heads(total_heads, tp, rank)
        if on_cpu and not compat.uses_mla(vllm_config.model_config):  # K of every token, then V, in one tensor
            head_size = int(vllm_config.model_config.get_head_size())
            isa = compat.cpu_attn_isa(vllm_config)
            return cells_of_cpu_tensor(info, num_blocks, block_size, heads, head_size, isa).with_first_head(first)
        return cells_of_tensor(info, num_blocks, block_size, heads).with_first_head(first)
    except ConfigError as e:
        logger.info("KV blocks planned whole only: %s", e)
        return None


def layerwise_under_cudagraphs(cfg: ConnectorConfig, vllm_config: Any) -> ConnectorConfig:
    """Layer-wise push (P, transfer-id flow) writes each layer from save_kv_layer, which vLLM does
    not call in a batch it replays from a full CUDA graph; wait_for_save then writes every layer
    no hook covered, so nothing depends on the hook for correctness. Under cudagraph_mode FULL
    every prefill is such a batch: layer-wise push is off (whole-request writes after the
    prefill, as with "layerwise": false). Where only decode-only batches are (FULL_DECODE_ONLY,
    FULL_AND_PIECEWISE) it stays: prefills run eager or piecewise, hooks called."""
    if not (cfg.layerwise and cfg.role.produces):
        return cfg
    mode, prefills_full, decodes_full = compat.cudagraph_mode(vllm_config)
    if prefills_full:
        logger.warning(
            "cudagraph_mode %s: vLLM replays prefills from full CUDA graphs and calls no save_kv_layer, "
            "so layer-wise push is off: transfer-id prompts are written whole once their prefill ends. "
            "Run this prefill instance with cudagraph_mode PIECEWISE or FULL_AND_PIECEWISE (or "
            '--enforce-eager) for layer-wise push, or set "layerwise": false to silence this',
            mode,
        )
        return dataclasses.replace(cfg, layerwise=False)
    if decodes_full:
        logger.info(
            "cudagraph_mode %s: a step vLLM replays from a full CUDA graph (every request computing "
            "one token) calls no save_kv_layer; a layer-wise push in such a step is written whole "
            "when the forward pass ends (wait_for_save). Prefills run without full graphs: layer by layer",
            mode,
        )
    return cfg


def hybrid_modes(cfg: ConnectorConfig, groups: CacheGroups | None) -> ConnectorConfig:
    """A model of several KV cache groups: P's layer-wise writes are off so far (a prompt is written
    whole once its prefill ends): a layer's tensor holds another group's layer too."""
    if groups is None or not groups.hybrid or not cfg.layerwise:
        return cfg
    logger.info("a model of several KV cache groups: layer-wise push is off (transfer-id prompts are written whole)")
    return dataclasses.replace(cfg, layerwise=False)


class KVConnector(compat.KVConnectorBase_V1, compat.SupportsHMA):
    """Base of our connectors; a subclass names its transport kind (`transport_name`, a kind known to
    `kv_connectors.transports.create_transport`) and may set default extra-config keys."""

    transport_name: ClassVar[str] = "abstract"
    default_extra_config: ClassVar[dict[str, Any]] = {}
    _cache_hit_source = compat.P2P_HIT_SOURCE or compat.KVConnectorBase_V1._cache_hit_source

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        check_parallelism(vllm_config.parallel_config, type(self).__name__)
        super().__init__(vllm_config, role, kv_cache_config)
        compat.share_vllm_logging()
        compat.warn_if_untested()
        kvt = vllm_config.kv_transfer_config
        cfg = parse_config(kvt.engine_id, kvt.kv_role, kvt.kv_connector_extra_config, self.default_extra_config)
        self._groups = compat.cache_groups(kv_cache_config, type(self).__name__) if kv_cache_config is not None else None
        self._cfg: ConnectorConfig = hybrid_modes(layerwise_under_cudagraphs(cfg, vllm_config), self._groups)
        self._block_size = int(vllm_config.cache_config.block_size)
        tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        # The worker's rank in its TP group (parallel_config.rank counts TP ranks first).
        rank = int(getattr(vllm_config.parallel_config, "rank", 0) or 0) % tp_size
        dp_index = compat.data_parallel_index(vllm_config.parallel_config)
        self._cfg.check_ports(dp_index, tp_size)
        self._tp_size = tp_size
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._kv_device: torch.device | None = None  # the KV cache's GPU, once registered (None: host memory)
        if role == compat.KVConnectorRole.SCHEDULER:
            port = self._cfg.instance_port(dp_index, tp_size)
            self._sched = SchedulerSide(self._cfg, self._block_size, port, tp_size=tp_size, groups=self._groups)
        else:
            # On the thread vLLM creates us on (the engine's), before it starts its output threads.
            device_type = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
            affinity.apply(self._cfg.engine_cpus, str(device_type or ""))
            self._worker = WorkerSide(self._cfg, rank, self.make_transport, self.transport_name, tp_size=tp_size, dp_index=dp_index)
        logger.info(
            "%s (%s) role=%s engine=%s rank %d of %d (data-parallel index %d), side channel %s:%d (%s layout)",
            type(self).__name__,
            self.transport_name,
            self._cfg.role.value,
            self._cfg.engine_id,
            rank,
            tp_size,
            dp_index,
            self._cfg.side_channel_host,
            self._cfg.instance_port(dp_index, tp_size),
            self._cfg.side_channel_ports.value,
        )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks this (0.32 does not): registered memory cannot follow a sleeping engine's
        released KV cache, so sleep mode is refused rather than left to corrupt transfers."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """No. vLLM asks with the extra config only, not the role: True would cost every instance
        with this config, decode ones included, its full CUDA graphs. Where vLLM skips
        save_kv_layer (a batch replayed from a full graph) wait_for_save writes what no hook
        covered, and under cudagraph_mode FULL layer-wise push is off (layerwise_under_cudagraphs)."""
        return False

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33 calls this before a sleeping engine frees its KV cache (sleep mode only, which
        supports_sleep_mode refuses). Peers may be reading or writing that memory through our
        registrations: refused, so that vLLM's sleep fails instead of a transfer."""
        raise ConfigError(
            f"{type(self).__name__} does not support sleep mode: its KV cache stays registered with "
            f"{self.transport_name} for peers to read and write, so it cannot be released"
        )

    def restore_kv_caches(self) -> None:
        """Nothing to restore: unregister_kv_caches never drops the registrations."""
        return None

    def make_transport(self, name: str) -> Transport:
        return create_transport(self.transport_name, name, self._cfg)

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "worker-side method called on the scheduler connector"
        return self._worker

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._sched is not None, "scheduler-side method called on the worker connector"
        return self._sched

    # worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        infos = [tensor_info(name, t) for name, t in kv_caches.items()]
        num_blocks = int(self._kv_cache_config.num_blocks)
        facts = compat.model_facts(self._vllm_config)
        layout = build_layout(infos, num_blocks, self._block_size)
        first = next(iter(kv_caches.values()))
        on_cpu = first.device.type == "cpu"
        cells = kv_cells(self._vllm_config, infos[0], num_blocks, int(facts["num_kv_heads"]), self.worker_side.rank, on_cpu)
        layout = dataclasses.replace(layout, cells=cells)
        if layout.cells is not None:
            facts["block_size"] = 0  # planned token by token: P's and D's may differ
        compat_info = CompatInfo(layout=layout.compat_signature(), groups=self._group_signature(), **facts)
        kind = MemoryKind.DEVICE if first.device.type != "cpu" else MemoryKind.HOST
        self._kv_device = None if on_cpu else first.device  # writes from it wait for its kernels (device.py)
        # A hybrid's groups overlay one tensor: its KV is complete once the last layer sharing it has run.
        owners = layer_regions(infos, layout, last_owns=bool(self._groups and self._groups.hybrid))
        self.worker_side.register(layout, compat_info, kind, first.device.index or 0, owners)
        # Rank 0 names the others' side channels to peers (config.PortLayout): every rank's, gathered.
        self.worker_side.set_directory(compat.tp_all_gather(self.worker_side.address, self._tp_size))

    def _group_signature(self) -> tuple[tuple[str, int, int, int], ...]:
        return self._groups.signature() if self._groups is not None else ()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Called before the forward pass (vLLM starts asynchronous loads only after it): the one
        moment to set up layer-wise pushes whose layers the coming forward pass computes."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, ConnectorMetadata):
            self._before_forward(connector_metadata)

    @_in_forward_step(lambda: None)
    def _before_forward(self, meta: ConnectorMetadata) -> None:
        self.worker_side.before_forward(meta)

    @_in_forward_step(lambda: None)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata if isinstance(self._connector_metadata, ConnectorMetadata) else None
        self.worker_side.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete between steps (asynchronous), never inside the forward pass

    @_in_forward_step(lambda: None)
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Layer-wise push: a waiting D gets this layer's blocks (transfer-id flow only) once the
        kernels that fill them ran: on a GPU they are still queued when the attention op returns."""
        side = self.worker_side
        side.on_layer_saved(layer_name, device.ready_signal(self._kv_device) if side.writes_layers() else None)

    @_in_forward_step(lambda: None)
    def wait_for_save(self) -> None:
        """Never blocks: layer-wise writes complete between steps like every other transfer; what no
        layer hook covered is written once the forward pass's kernels ran."""
        side = self.worker_side
        side.end_of_forward(device.ready_signal(self._kv_device) if side.writes_layers() else None)

    @_in_forward_step(lambda: compat.transfer_results(set(), set(), set()))
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        sending, recving, failed = self.worker_side.take_results()
        return compat.transfer_results(sending, recving, failed)

    @_in_forward_step(lambda: (None, None))
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _failed = self.worker_side.take_results()
        return sending or None, recving or None

    def get_kv_connector_stats(self) -> KvcStats | None:
        """Both sides: vLLM's scheduler merges its connector's stats into the worker's each step."""
        if self._worker is not None:
            return self._worker.take_interval_stats()
        return self._sched.take_stats() if self._sched is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvcStats:
        return KvcStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvcPromMetrics:
        return KvcPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        self.scheduler_side.on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished_all_groups(request, block_ids)


class NixlConnector(KVConnector):
    """KV transfer over NIXL (UCX): D reads P's blocks (pull) or P writes them (push)."""

    transport_name = "nixl"


class MooncakeConnector(KVConnector):
    """KV transfer over the Mooncake Transfer Engine (P2PHANDSHAKE, tcp or rdma); P pushes by default."""

    transport_name = "mooncake"
    default_extra_config: ClassVar[dict[str, Any]] = config.TRANSPORT_DEFAULTS["mooncake"]
