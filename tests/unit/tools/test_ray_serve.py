"""kv_connectors.ray_serve: what it hands Ray Serve LLM's PD app (the kv_transfer_config, the LLMConfigs,
the PD app's arguments), and its backend against Ray 2.60.0's connector-backend interface
(tests/unit/tools/ray_serve_interface.py, a faithful copy: Ray is not in the test venv): registered
under our names, it gives each replica the side channel that our connector then reads, and Ray's
request shaping carries what our P and D exchange. The real Ray ran it end to end:
benchmarks/gpu/ray_serve_pd.py (`make test-ray-serve`)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any
from unittest import mock

import pytest

from kv_connectors import checks, params, ray_serve
from kv_connectors.config import parse_config
from tests.unit.tools import ray_serve_interface as ray_copy


@pytest.fixture
def ray(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Ray's backend interface under Ray's module names; ray_serve's lazy class built anew; the
    process environment restored afterwards (Ray's set-up writes os.environ)."""
    ray_copy.install(monkeypatch)
    monkeypatch.setattr(ray_serve, "_LAZY", {})
    with mock.patch.dict(os.environ):
        for var in ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST"):
            os.environ.pop(var, None)
        yield ray_copy


def test_importing_it_imports_neither_ray_nor_vllm() -> None:
    code = (
        "import sys, kv_connectors.ray_serve as r; assert r.BACKEND_PATH\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
@pytest.mark.parametrize("role", ray_serve.ROLES)
def test_each_kv_transfer_config_would_start(transport: str, role: str) -> None:
    config = ray_serve.kv_transfer_config(role, transport, {"transfer_timeout_s": 10})
    checked = checks.check_transfer_config(config)  # vLLM's KVTransferConfig, then every start-up check of ours
    assert checked.kind == transport and checked.config.transfer_timeout_s == 10
    if transport == "nixl":  # the name Ray's own NixlConnectorBackend serves, loading ours
        assert config["kv_connector"] == "NixlConnector" and config["kv_connector_module_path"] == "kv_connectors.nixl"
        assert not ray_serve.needs_registration(config)
    else:
        assert config["kv_connector"] in ray_serve.BACKEND_NAMES and ray_serve.needs_registration(config)


@pytest.mark.parametrize("key", ray_serve.RAY_ASSIGNED)
def test_a_fixed_side_channel_is_refused_with_what_to_use(key: str) -> None:
    with pytest.raises(ValueError, match=f"sets {key}.*NIXL_SIDE_CHANNEL_PORT_BASE"):
        ray_serve.kv_transfer_config("kv_consumer", extra={key: 5720 if key.endswith("port") else "10.0.0.1"})


def test_bad_roles_transports_and_engine_kwargs_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_both"):
        ray_serve.kv_transfer_config("kv_both")
    with pytest.raises(ValueError, match="transport"):
        ray_serve.kv_transfer_config("kv_producer", "lmcache")
    with pytest.raises(ValueError, match="pass transport and extra"):
        ray_serve.llm_config("kv_producer", "m", engine_kwargs={"kv_transfer_config": {}})


def test_pd_serving_args_give_p_and_d_one_model_and_rays_port_bases() -> None:
    engine = {"dtype": "float32", "enforce_eager": True}
    args = ray_serve.pd_serving_args(
        "tiny",
        "/models/tiny",
        decode_extra={"transfer_timeout_s": 10},
        engine_kwargs=engine,
        deployment_config={"num_replicas": 2},
        experimental_configs={"stream_batching_interval_ms": 0},
    )
    p, d = args["prefill_config"], args["decode_config"]
    assert p["model_loading_config"] == d["model_loading_config"] == {"model_id": "tiny", "model_source": "/models/tiny"}
    assert p["experimental_configs"] == {"stream_batching_interval_ms": 0, "NIXL_SIDE_CHANNEL_PORT_BASE": 20000}
    assert d["experimental_configs"]["NIXL_SIDE_CHANNEL_PORT_BASE"] == 22000  # PDServingArgs' decode default
    assert (
        p["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_producer"
        and "kv_connector_extra_config" not in p["engine_kwargs"]["kv_transfer_config"]
    )
    assert d["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"] == {"transfer_timeout_s": 10}
    assert p["engine_kwargs"]["dtype"] == "float32" and p["deployment_config"] == {"num_replicas": 2}
    # Ray's set-up writes engine_id into each side's kv_transfer_config: nothing shared between them or with the caller.
    assert p["engine_kwargs"] is not d["engine_kwargs"] and "kv_transfer_config" not in engine
    moved = ray_serve.llm_config("kv_consumer", "tiny", port_base=23000)
    assert moved["experimental_configs"]["NIXL_SIDE_CHANNEL_PORT_BASE"] == 23000


def test_register_backends_puts_ours_under_our_names_only(ray: Any) -> None:
    factory = ray.KVConnectorBackendFactory
    assert factory.get_backend_class("KvcNixlConnector") is ray.DefaultConnectorBackend  # before: Ray's no-op default
    assert ray_serve.register_backends() == list(ray_serve.BACKEND_NAMES)
    assert ray_serve.register_backends() == []  # registered once; Ray refuses a second registration of a name
    for name in ray_serve.BACKEND_NAMES:
        cls = factory.get_backend_class(name)  # Ray loads "kv_connectors.ray_serve:KvcConnectorBackend"
        assert cls is ray_serve.KvcConnectorBackend and issubclass(cls, ray.NixlConnectorBackend)
        assert (cls.__module__, cls.__qualname__) == ("kv_connectors.ray_serve", "KvcConnectorBackend")
    assert factory.get_backend_class("NixlConnector") is ray.NixlConnectorBackend  # Ray's own, left alone


SETUPS = [("nixl", "kv_producer", None, 20000), ("mooncake", "kv_consumer", 1, 22001)]  # no DP rank: replica rank 0


@pytest.mark.parametrize(("transport", "role", "dp_rank", "port"), SETUPS)
def test_rays_backend_set_up_becomes_our_side_channel(ray: Any, transport: str, role: str, dp_rank: int | None, port: int) -> None:
    """What a replica does before vLLM starts (LLMConfig.setup_engine_backend: create_backend by the
    kv_connector name, then setup), then what our connector reads at start-up."""
    ray_serve.register_backends()
    side = ray_serve.llm_config(role, "tiny", transport=transport, extra={"transfer_timeout_s": 10})
    engine_kwargs = {**side["engine_kwargs"], **({} if dp_rank is None else {"data_parallel_rank": dp_rank})}
    llm = ray.LLMConfig(engine_kwargs, side["experimental_configs"])
    kv = engine_kwargs["kv_transfer_config"]
    backend = ray.KVConnectorBackendFactory.create_backend(kv["kv_connector"], llm)
    assert isinstance(backend, ray.NixlConnectorBackend)
    backend.setup()
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(port) and os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == ray.NODE_IP
    assert kv["engine_id"].endswith(f"-{ray.NODE_IP}-{port}")
    ours = parse_config(kv["engine_id"], kv["kv_role"], kv["kv_connector_extra_config"])
    assert (ours.side_channel_host, ours.side_channel_port, ours.transfer_timeout_s) == (ray.NODE_IP, port, 10)


def test_our_backend_refuses_a_fixed_side_channel_before_rays_set_up(ray: Any) -> None:
    ray_serve.register_backends()
    kv = {"kv_connector": "KvcNixlConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"side_channel_port": 5710}}
    backend = ray.KVConnectorBackendFactory.create_backend("KvcNixlConnector", ray.LLMConfig({"kv_transfer_config": kv}))
    with pytest.raises(ValueError, match="side_channel_port"):
        backend.setup()
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ and "engine_id" not in kv


class _Request:
    """The fields of Ray's CompletionRequest that its PD protocol touches."""

    def __init__(self) -> None:
        self.prompt, self.max_tokens, self.stream, self.kv_transfer_params = "The capital of France is", 16, True, None


class _Response:
    def __init__(self, kv_transfer_params: dict[str, Any]) -> None:
        self.kv_transfer_params = kv_transfer_params


def test_rays_request_shaping_carries_what_our_p_and_d_exchange(ray: Any) -> None:
    """P gets Ray's params (do_remote_decode, the rest null) and one token; D gets P's answer as our P
    states it, and loads from it."""
    ray_serve.register_backends()
    kv = ray_serve.kv_transfer_config("kv_consumer", "mooncake")
    backend = ray.KVConnectorBackendFactory.create_backend(kv["kv_connector"], ray.LLMConfig({"kv_transfer_config": kv}))
    request = _Request()
    to_p = backend.prepare_prefill_request(request=request, peer=None)
    assert (to_p.max_tokens, to_p.stream) == (1, False) and request.kv_transfer_params is None
    at_p = params.parse_request_params(to_p.kv_transfer_params)
    assert at_p.remote_decode and not at_p.remote_prefill and at_p.transfer_id is None and at_p.transfer_id_error is None
    answer = params.producer_params(
        block_ids=[3, 4], engine_id="p-10.20.30.40-20000", request_id="cmpl-1", host=ray.NODE_IP, port=20000, num_tokens=40
    )
    to_d = backend.prepare_decode_request(request=request, peer=None, prefill_response=_Response(answer))
    assert to_d.max_tokens == 16 and to_d.stream
    at_d = params.parse_request_params(to_d.kv_transfer_params)
    assert at_d.remote_prefill and at_d.prefill is not None and at_d.prefill_error is None
    assert at_d.prefill.peer_key == ("p-10.20.30.40-20000", ray.NODE_IP, 20000) and at_d.prefill.remote_block_ids == (3, 4)
