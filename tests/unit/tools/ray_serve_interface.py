"""A minimal, faithful copy of Ray Serve LLM 2.60.0's connector-backend interface, for testing
kv_connectors.ray_serve where Ray is not installed (it is not in the test venv: ray[llm] pins vLLM
0.29.0). Rewritten from, and behaving as, these files of the ray 2.60.0 wheel:

- ray/llm/_internal/serve/engines/vllm/kv_transfer/base.py: BaseConnectorBackend (the llm_config,
  the kv_transfer_config property, _get_unique_suffix, _compute_port_offset: the data-parallel rank,
  else the replica rank x num_devices), DefaultPDProtocolMixin (P's params and the one-token clamp;
  D gets P's answer's kv_transfer_params), DefaultConnectorBackend;
- .../kv_transfer/nixl.py: NixlConnectorBackend.setup (vLLM must define the two variables; the port
  is NIXL_SIDE_CHANNEL_PORT_BASE (default 20000) + the offset unless VLLM_NIXL_SIDE_CHANNEL_PORT is
  set; the host is the node's IP unless VLLM_NIXL_SIDE_CHANNEL_HOST is set; engine_id becomes
  "<engine_id or a random suffix>-<host>-<port>");
- .../kv_transfer/factory.py and ray/llm/_internal/serve/utils/registry.py: KVConnectorBackendFactory
  over a name registry that takes a class or a "module:Class" path (loaded on first get), refuses a
  second registration of a name, and falls back to DefaultConnectorBackend for unknown names;
  BUILTIN_BACKENDS registered at import.

Only what kv_connectors.ray_serve and its tests touch; Ray's cluster-wide KV store, its logging and
Serve's replica context are reduced to a dict, nothing and `REPLICA_RANK`. `install(monkeypatch)`
puts these under Ray's module names in sys.modules.
"""

from __future__ import annotations

import abc
import copy
import importlib
import os
import random
import string
import sys
import types
from typing import Any

import pytest

PREFIX = "ray.llm._internal.serve.engines.vllm.kv_transfer"
NODE_IP = "10.20.30.40"  # ray.util.get_node_ip_address() here
REPLICA_RANK = 0  # serve.get_replica_context().rank.rank here


def base_prefill_kv_transfer_params() -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None}


def clamp_request_to_single_token(request: Any) -> None:
    request.max_tokens = 1
    if hasattr(request, "max_completion_tokens"):
        request.max_completion_tokens = 1
    request.stream = False
    if hasattr(request, "stream_options"):
        request.stream_options = None


class BaseConnectorBackend(abc.ABC):
    requires_peer_binding: bool = False
    concurrent_handoff: bool = False

    def __init__(self, llm_config: Any):
        self.llm_config = llm_config

    @property
    def kv_transfer_config(self) -> dict[str, Any]:
        kv_transfer_config = self.llm_config.engine_kwargs.get("kv_transfer_config")
        assert kv_transfer_config is not None, "In Connector backend, kv_transfer_config is not set"
        return kv_transfer_config

    def _get_unique_suffix(self, len: int = 6) -> str:  # noqa: A002 - Ray's signature
        return "".join(random.choices(string.ascii_letters + string.digits, k=len))

    def _compute_port_offset(self) -> int:
        dp_rank = self.llm_config.engine_kwargs.get("data_parallel_rank")
        if isinstance(dp_rank, int) and dp_rank >= 0:
            return dp_rank
        return REPLICA_RANK * self.llm_config.num_devices

    @abc.abstractmethod
    def prepare_prefill_request(self, *, request: Any, peer: Any) -> Any: ...

    @abc.abstractmethod
    def prepare_decode_request(self, *, request: Any, peer: Any, prefill_response: Any) -> Any: ...

    def setup(self) -> None:  # noqa: B027 - Ray's no-op default
        pass

    def replica_metadata(self) -> dict[str, Any]:
        return {}


class DefaultPDProtocolMixin:
    def prepare_prefill_request(self, *, request: Any, peer: Any) -> Any:
        assert getattr(request, "kv_transfer_params", None) is None, "kv_transfer_params should be empty before orchestrator"
        prefill_request = copy.deepcopy(request)  # Ray: request.model_copy(deep=True)
        prefill_request.kv_transfer_params = {**base_prefill_kv_transfer_params(), "remote_host": None, "remote_port": None}
        clamp_request_to_single_token(prefill_request)
        return prefill_request

    def prepare_decode_request(self, *, request: Any, peer: Any, prefill_response: Any) -> Any:
        decode_request = copy.deepcopy(request)
        if prefill_response is not None:
            decode_request.kv_transfer_params = prefill_response.kv_transfer_params
        return decode_request


class DefaultConnectorBackend(DefaultPDProtocolMixin, BaseConnectorBackend):
    pass


class NixlConnectorBackend(DefaultPDProtocolMixin, BaseConnectorBackend):
    def _set_side_channel_port(self) -> None:
        from vllm import envs as vllm_envs

        if vllm_envs.is_set("VLLM_NIXL_SIDE_CHANNEL_PORT"):
            return
        base_port = int(self.llm_config.experimental_configs.get("NIXL_SIDE_CHANNEL_PORT_BASE", 20000))
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(base_port + self._compute_port_offset())

    def _set_side_channel_host(self) -> None:
        from vllm import envs as vllm_envs

        if not vllm_envs.is_set("VLLM_NIXL_SIDE_CHANNEL_HOST"):
            os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = NODE_IP

    def setup(self) -> None:
        from vllm import envs as vllm_envs

        if (
            "VLLM_NIXL_SIDE_CHANNEL_PORT" not in vllm_envs.environment_variables
            or "VLLM_NIXL_SIDE_CHANNEL_HOST" not in vllm_envs.environment_variables
        ):
            raise ValueError("This vLLM version does not support VLLM_NIXL_SIDE_CHANNEL_PORT or _HOST")
        self._set_side_channel_port()
        self._set_side_channel_host()
        engine_id = self.kv_transfer_config.get("engine_id", self._get_unique_suffix())
        host = vllm_envs.VLLM_NIXL_SIDE_CHANNEL_HOST
        port = vllm_envs.VLLM_NIXL_SIDE_CHANNEL_PORT
        self.kv_transfer_config["engine_id"] = "-".join([engine_id, host, str(port)])


class _Registry:
    """registry.ComponentRegistry without the cluster KV store: the loaders in one process."""

    def __init__(self) -> None:
        self.loaders: dict[str, Any] = {}
        self.resolved: dict[str, Any] = {}

    def register(self, name: str, value: Any) -> None:
        if name in self.loaders:
            raise ValueError(f"kv_connector_backend '{name}' is already registered.")
        if isinstance(value, str):
            if ":" not in value:
                raise ValueError(f"Invalid format for string value: '{value}'.")
            module_path, class_name = value.rsplit(":", 1)
            self.loaders[name] = lambda: getattr(importlib.import_module(module_path), class_name)
        else:
            self.loaders[name] = lambda: value

    def get(self, name: str) -> Any:
        if name in self.resolved:
            return self.resolved[name]
        if name not in self.loaders:
            raise ValueError(f"kv_connector_backend '{name}' not found.")
        self.resolved[name] = self.loaders[name]()
        return self.resolved[name]

    def contains(self, name: str) -> bool:
        return name in self.loaders


_REGISTRY = _Registry()


class KVConnectorBackendFactory:
    @classmethod
    def register_backend(cls, name: str, backend_class_or_path: Any) -> None:
        _REGISTRY.register(name, backend_class_or_path)

    @classmethod
    def get_backend_class(cls, name: str) -> type:
        try:
            return _REGISTRY.get(name)  # type: ignore[no-any-return]
        except ValueError:
            return DefaultConnectorBackend
        except Exception as e:
            raise ImportError(f"Failed to load connector backend '{name}': {type(e).__name__}: {e}") from e

    @classmethod
    def create_backend(cls, name: str, llm_config: Any) -> BaseConnectorBackend:
        return cls.get_backend_class(name)(llm_config)  # type: ignore[no-any-return]

    @classmethod
    def is_registered(cls, name: str) -> bool:
        return _REGISTRY.contains(name)


BUILTIN_BACKENDS = {
    "LMCacheConnectorV1": f"{PREFIX}.lmcache:LMCacheConnectorV1Backend",
    "NixlConnector": f"{PREFIX}.nixl:NixlConnectorBackend",
    "MultiConnector": f"{PREFIX}.multi_connector:MultiConnectorBackend",
    "MoRIIOConnector": f"{PREFIX}.moriio:MoRIIOConnectorBackend",
}


class LLMConfig:
    """The LLMConfig fields the backends read (Ray's is a pydantic model; `num_devices` is its engine
    config's tensor x pipeline parallel size)."""

    def __init__(self, engine_kwargs: dict[str, Any], experimental_configs: dict[str, Any] | None = None) -> None:
        self.engine_kwargs = engine_kwargs
        self.experimental_configs = dict(experimental_configs or {})
        self.num_devices = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get("pipeline_parallel_size", 1)


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's module names -> this copy, in sys.modules (monkeypatch undoes it), with a fresh registry
    holding Ray's built-in backends."""
    monkeypatch.setattr(sys.modules[__name__], "_REGISTRY", _Registry())
    names = PREFIX.split(".")
    for i in range(1, len(names) + 1):
        monkeypatch.setitem(sys.modules, ".".join(names[:i]), types.ModuleType(".".join(names[:i])))
    this = sys.modules[__name__]
    for leaf in ("base", "nixl", "factory"):
        monkeypatch.setitem(sys.modules, f"{PREFIX}.{leaf}", this)
    for name, path in BUILTIN_BACKENDS.items():
        KVConnectorBackendFactory.register_backend(name, path)
