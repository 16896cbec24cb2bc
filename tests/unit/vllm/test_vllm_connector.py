"""The connector class against vLLM's own interface and config objects: the hooks vLLM calls (and
the ones 0.33 adds), the tested vLLM range, sleep mode, CUDA graph modes, and the facade driven with
vLLM's real Request / KVCacheBlocks / SchedulerOutput. `make test-vllm-next` runs this file on
vLLM 0.33's sources."""

from __future__ import annotations

import inspect
import logging

import pytest
from vllm.config import CUDAGraphMode, KVTransferConfig
from vllm.v1.request import RequestStatus

from kv_connectors.errors import ConfigError
from kv_connectors.mooncake import MooncakeConnector
from kv_connectors.nixl import NixlConnector
from kv_connectors.vllm import compat
from kv_connectors.vllm.connector import KVConnector
from kv_connectors.vllm.metadata import ConnectorMetadata
from tests.unit.vllm.vllm_objects import blocks, finish, request, step, vllm_config

BASE = compat.KVConnectorBase_V1
# Hooks of vLLM 0.33 we answer on 0.32 as well (0.32's base class has none of them).
NEWER_HOOKS = {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"}


# the interface ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [NixlConnector, MooncakeConnector])
def test_every_hook_we_override_is_vllms_with_vllms_parameters(cls):
    assert not cls.__abstractmethods__
    overridden = {n for n, v in vars(KVConnector).items() if callable(v) or isinstance(v, (classmethod, staticmethod))}
    overridden -= {n for n in overridden if n.startswith("_") and n != "__init__"}
    for name in sorted(overridden):
        theirs = getattr(BASE, name, None) or getattr(compat.SupportsHMA, name, None)
        if theirs is None:
            assert name in NEWER_HOOKS or name in {"make_transport", "worker_side", "scheduler_side"}, (
                f"{name} is not a hook of this vLLM: renamed or gone?"
            )
            continue
        ours = getattr(cls, name)
        kind_ours = type(inspect.getattr_static(cls, name))
        kind_theirs = type(inspect.getattr_static(BASE if hasattr(BASE, name) else compat.SupportsHMA, name))
        assert kind_ours is kind_theirs, f"{name}: {kind_ours.__name__}, vLLM's is {kind_theirs.__name__}"
        if isinstance(ours, property):
            continue
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name


def test_the_running_vllm_is_in_the_tested_range():
    assert compat.untested_vllm(compat.VLLM_VERSION) is None, compat.VLLM_VERSION


def test_the_gpu_extra_declares_the_tested_range():
    """What users install on GPU hosts and what start-up warns outside of are one range."""
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = [r for r in extras["gpu"] if r.startswith("vllm")]
    assert declared == [f"vllm{compat.TESTED_VLLM}"], declared


@pytest.mark.parametrize(
    ("version", "tested"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.33.0", True),
        ("0.33.1.dev5+g1234abc", True),
        ("0.31.9", False),
        ("0.32.0rc1", True),
        ("0.33.9", True),
        ("0.31.99", False),
        ("0.34.0.dev0", False),
        ("0.34.0", False),
        ("1.0.0", False),
        ("1.33.0", False),
        ("0.3", False),
        ("not-a-version", False),
    ],
)
def test_versions_outside_the_tested_range_are_named(version, tested):
    problem = compat.untested_vllm(version)
    assert (problem is None) == tested, problem
    if not tested:
        assert compat.TESTED_VLLM in problem and version in problem


def test_an_untested_vllm_is_warned_about_at_start_up(monkeypatch, caplog):
    monkeypatch.setattr(compat, "VLLM_VERSION", "0.35.2")
    monkeypatch.setattr(compat, "_warned_versions", set())
    with caplog.at_level(logging.WARNING, logger="kv_connectors"):
        NixlConnector(vllm_config("kv_consumer"), compat.KVConnectorRole.SCHEDULER, None)
        NixlConnector(vllm_config("kv_producer"), compat.KVConnectorRole.SCHEDULER, None)
    warnings = [r.getMessage() for r in caplog.records if "tested with vllm" in r.getMessage()]
    assert len(warnings) == 1 and "vLLM 0.35.2" in warnings[0], warnings  # once per process
    caplog.clear()
    monkeypatch.setattr(compat, "VLLM_VERSION", "0.33.0")
    with caplog.at_level(logging.WARNING, logger="kv_connectors"):
        NixlConnector(vllm_config("kv_consumer"), compat.KVConnectorRole.SCHEDULER, None)
    assert not [r for r in caplog.records if "tested with vllm" in r.getMessage()]


# sleep mode ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_sleep_mode_is_refused(transport):
    """Registered KV memory cannot follow a sleeping engine's released cache: vLLM 0.33 asks
    supports_sleep_mode and refuses --enable-sleep-mode at start-up; 0.32 does not ask (and never
    tells a connector it sleeps), so there the question is ours alone."""
    cfg = vllm_config("kv_producer", transport=transport)
    kvt = cfg.kv_transfer_config
    cls = compat.KVConnectorFactory.get_connector_class(kvt)
    assert cls is {"nixl": NixlConnector, "mooncake": MooncakeConnector}[transport]
    assert cls.supports_sleep_mode(kvt) is False
    gate = getattr(type(cfg), "_verify_kv_transfer_compat", None)
    if hasattr(BASE, "supports_sleep_mode"):  # 0.33: vLLM's own start-up check refuses it
        assert gate is not None
        cfg.model_config = type("ModelConfig", (), {"enable_sleep_mode": True, "enable_cumem_allocator": False})()
        with pytest.raises(ValueError, match="does not support sleep mode"):
            gate(cfg)
        cfg.model_config.enable_sleep_mode = False
        gate(cfg)
    else:  # 0.32: no such hook, no such check
        assert gate is None or "supports_sleep_mode" not in inspect.getsource(gate)


def test_kv_cache_registrations_are_never_dropped_under_a_sleeping_engine():
    """vLLM 0.33's Worker.sleep and discard call unregister_kv_caches before freeing the KV cache
    (only with sleep mode, which we refuse): we refuse too, so the memory stays where peers may be
    reading or writing it, and vLLM's sleep fails instead of corrupting a transfer."""
    connector = NixlConnector(vllm_config("kv_producer"), compat.KVConnectorRole.WORKER, None)
    try:
        with pytest.raises(ConfigError, match="sleep mode"):
            connector.unregister_kv_caches()
        assert connector.restore_kv_caches() is None  # nothing was dropped: nothing to restore
    finally:
        connector.shutdown()


# CUDA graphs ------------------------------------------------------------------------------------
def test_piecewise_cuda_graphs_are_not_required():
    """vLLM asks this with the extra config only (not the role): True would cost every instance,
    decode ones included, its full CUDA graphs. Nothing depends on the per-layer hook for
    correctness: wait_for_save writes every layer no hook covered (the cases below)."""
    assert "requires_piecewise_for_cudagraph" in vars(KVConnector)
    for extra in ({}, {"layerwise": True}, {"layerwise": False}, {"mode": "push"}):
        kvt = KVTransferConfig(kv_connector="KvcNixlConnector", kv_role="kv_producer", kv_connector_extra_config=extra)
        assert NixlConnector.requires_piecewise_for_cudagraph(kvt.kv_connector_extra_config) is False
        assert MooncakeConnector.requires_piecewise_for_cudagraph(kvt.kv_connector_extra_config) is False


# Each mode: (layer-wise push stays on, what P's log says). A mode a later vLLM adds fails here.
CUDAGRAPH_CASES = {
    "NONE": (True, None),
    "PIECEWISE": (True, None),
    "FULL": (False, "layer-wise push is off"),
    "FULL_DECODE_ONLY": (True, "written whole when the forward pass ends"),
    "FULL_AND_PIECEWISE": (True, "written whole when the forward pass ends"),
}


def test_every_cudagraph_mode_has_a_decision():
    assert {m.name for m in CUDAGraphMode} == set(CUDAGRAPH_CASES)


def _layerwise_marked(connector: KVConnector) -> bool:
    """Whether P's scheduler side lists a transfer-id prefill for layer-wise writes (real objects)."""
    r = request("p", list(range(64)), {"do_remote_decode": True, "transfer_id": "t-1"}, max_tokens=1)
    connector.get_num_new_matched_tokens(r, 0)
    meta = connector.build_connector_meta(step((r, [3, 4], 64)))
    return "p" in meta.reqs_layerwise


@pytest.mark.parametrize("mode", list(CUDAGraphMode), ids=lambda m: m.name)
@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_layerwise_push_under_each_cudagraph_mode(mode, transport, caplog):
    """A batch vLLM replays from a full CUDA graph calls no save_kv_layer. Under FULL every prefill
    is one: P falls back to whole-request writes (layer-wise off on both sides, said in the log).
    Where only decode-only batches are (FULL_DECODE_ONLY, FULL_AND_PIECEWISE: prefills run eager or
    piecewise, hooks called) layer-wise stays, and the log says what a replayed step does. D
    instances and "layerwise": false are left alone, silently."""
    stays, said = CUDAGRAPH_CASES[mode.name]
    with caplog.at_level(logging.INFO, logger="kv_connectors"):
        sched = compat_connector(transport, "kv_producer", {}, mode, compat.KVConnectorRole.SCHEDULER)
        worker = compat_connector(transport, "kv_producer", {}, mode, compat.KVConnectorRole.WORKER)
    try:
        assert sched._cfg.layerwise is stays and worker.worker_side._cfg.layerwise is stays
        assert _layerwise_marked(sched) is stays
        logged = [r for r in caplog.records if "save_kv_layer" in r.getMessage()]
        if said is None:
            assert not logged
        else:
            assert len(logged) == 2 and all(said in r.getMessage() and mode.name in r.getMessage() for r in logged)
            assert all(r.levelno == (logging.WARNING if not stays else logging.INFO) for r in logged)
    finally:
        worker.shutdown()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kv_connectors"):
        for role, extra in (("kv_consumer", {}), ("kv_producer", {"layerwise": False})):
            other = compat_connector(transport, role, extra, mode, compat.KVConnectorRole.SCHEDULER)
            assert other._cfg.layerwise is (role == "kv_consumer")
    assert not [r for r in caplog.records if "save_kv_layer" in r.getMessage()]


def compat_connector(transport: str, role: str, extra: dict, mode: CUDAGraphMode, side: compat.KVConnectorRole) -> KVConnector:
    cfg = vllm_config(role, extra, transport=transport, cudagraph_mode=mode)
    cls = compat.KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    return cls(cfg, side, None)


# the facade with vLLM's objects --------------------------------------------------------------------
def test_p_and_d_through_the_connector_with_vllms_objects():
    """The hooks vLLM's scheduler calls, in its order, on the connector it builds from the
    module-path form: P's prefill hands off its blocks (request_finished_all_groups with vLLM's
    tuple of per-group block lists), D loads them."""
    p_cfg = vllm_config("kv_producer")
    p = compat.KVConnectorFactory.get_connector_class(p_cfg.kv_transfer_config)(p_cfg, compat.KVConnectorRole.SCHEDULER, None)
    prompt = list(range(80))
    pr = request("p-1", prompt, {"do_remote_decode": True}, max_tokens=1)
    p.on_new_request(pr)
    assert p.get_num_new_matched_tokens(pr, 0) == (0, False)
    p.update_state_after_alloc(pr, blocks([4, 5, 6]), 0)
    meta = p.build_connector_meta(step((pr, [4, 5, 6], 80)))
    assert isinstance(meta, ConnectorMetadata) and isinstance(meta, compat.KVConnectorMetadata)
    delay, params = p.request_finished_all_groups(finish(pr, RequestStatus.FINISHED_LENGTH_CAPPED), ([4, 5, 6],))
    assert delay and params["remote_block_ids"] == [4, 5, 6] and params["remote_request_id"] == "p-1"
    assert p.build_connector_meta(step()).reqs_to_send["p-1"].block_ids == (4, 5, 6)

    d_cfg = vllm_config("kv_consumer")
    d = compat.KVConnectorFactory.get_connector_class(d_cfg.kv_transfer_config)(d_cfg, compat.KVConnectorRole.SCHEDULER, None)
    dr = request("d-1", prompt, params)
    d.on_new_request(dr)
    assert d.get_num_new_matched_tokens(dr, 32) == (48, True)
    d.update_state_after_alloc(dr, blocks([8, 9], hits=[7]), 48)
    spec = d.build_connector_meta(step((dr, [7, 8, 9], 0))).reqs_to_recv["d-1"]
    assert (spec.local_block_ids, spec.remote_block_ids, spec.tokens.first, spec.tokens.count) == ((8, 9), (5, 6), 32, 48)
    assert d.request_finished_all_groups(finish(dr, RequestStatus.FINISHED_STOPPED), ([7, 8, 9],)) == (False, None)
