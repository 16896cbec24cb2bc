"""Our connectors under Ray Serve LLM's prefill/decode app (`ray.serve.llm.build_pd_openai_app`).

Ray Serve LLM starts each side's vLLM engine from an `LLMConfig` whose `engine_kwargs` carry the
`kv_transfer_config`. Before the engine starts, it runs the *connector backend* its factory finds
under the config's `kv_connector` name; the backend also shapes the PD requests (P gets `max_tokens`
1, `stream` false and `kv_transfer_params: {"do_remote_decode": true, ...}`; D gets P's answer's
`kv_transfer_params`: the flow our P and D serve for vllm-router). A name the factory does not know
gets `DefaultConnectorBackend`, whose set-up does nothing.

Ray's backend for `NixlConnector` gives each replica its own side channel through vLLM's environment
variables: `VLLM_NIXL_SIDE_CHANNEL_PORT` = a base (`experimental_configs["NIXL_SIDE_CHANNEL_PORT_BASE"]`,
20000 for prefill and 22000 for decode in the PD app) plus the replica's offset (its data-parallel
rank, else its replica rank x TP x PP), and `VLLM_NIXL_SIDE_CHANNEL_HOST` = the node's IP. It also
makes `engine_id` unique per replica. Our connectors take those variables as the defaults of
`side_channel_port` and `side_channel_host` (`config.BUILTIN_ENV`), so:

- `"kv_connector": "NixlConnector"` with `"kv_connector_module_path": "kv_connectors.nixl"` gets Ray's
  own NIXL backend: nothing to register (`kv_transfer_config("kv_producer")`);
- the names Ray does not know (`KvcNixlConnector`, `KvcMooncakeConnector`) would get the default
  backend: every replica on our default port, so a P and a D on one node collide.
  `register_backends()`, run in the driver before `serve.run`, registers `KvcConnectorBackend` (Ray's
  NIXL backend's set-up) under them; Ray's registry carries it to every replica. Mooncake under Ray:
  `kv_transfer_config(role, transport="mooncake")`, which names `KvcMooncakeConnector`.

A `side_channel_port` or `side_channel_host` in `kv_connector_extra_config` would override Ray's
per-replica variables (replicas on one node would then share a port): refused here; move the base
with `NIXL_SIDE_CHANNEL_PORT_BASE` in the LLMConfig's `experimental_configs` instead.

Mirrors ray 2.60.0: ray/llm/_internal/serve/engines/vllm/kv_transfer/base.py (BaseConnectorBackend,
DefaultPDProtocolMixin), nixl.py (NixlConnectorBackend), factory.py (KVConnectorBackendFactory,
BUILTIN_BACKENDS) and serving_patterns/prefill_decode/builder.py (PDServingArgs,
build_pd_openai_app). Ray is optional (the `ray-serve` extra): it is imported only by
`register_backends()` and on first use of `KvcConnectorBackend` (module `__getattr__`); importing
this module imports neither Ray nor vLLM.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

RAY_VERSION = "2.60.0"  # the Ray Serve LLM whose interface this mirrors
ROLES = ("kv_producer", "kv_consumer")  # P and D in Ray's PD app
# transport -> (kv_connector, kv_connector_module_path) as the PD app's configs name them
CONNECTORS: dict[str, tuple[str, str | None]] = {
    "nixl": ("NixlConnector", "kv_connectors.nixl"),  # Ray's own NixlConnectorBackend
    "mooncake": ("KvcMooncakeConnector", None),  # our entry point name: register_backends()
}
BACKEND_NAMES = ("KvcNixlConnector", "KvcMooncakeConnector")  # our vLLM plugin's names (plugin.CONNECTORS)
BACKEND_PATH = f"{__name__}:KvcConnectorBackend"  # as Ray's registry loads a class lazily
PORT_BASE_KEY = "NIXL_SIDE_CHANNEL_PORT_BASE"  # experimental_configs key Ray's NIXL backend reads
PORT_BASES = {"kv_producer": 20000, "kv_consumer": 22000}  # Ray's defaults (nixl.py; PDServingArgs for decode)
RAY_ASSIGNED = ("side_channel_port", "side_channel_host")  # set per replica through VLLM_NIXL_SIDE_CHANNEL_*


def check_extra(extra: Mapping[str, Any] | None) -> None:
    """Refuse the keys Ray's backend assigns per replica (ValueError naming them and what to use)."""
    fixed = sorted(k for k in RAY_ASSIGNED if k in (extra or {}))
    if fixed:
        raise ValueError(
            f"kv_connector_extra_config sets {', '.join(fixed)}: under Ray Serve LLM each replica gets its "
            "side channel from Ray's connector backend (VLLM_NIXL_SIDE_CHANNEL_PORT = base + replica offset, "
            f"VLLM_NIXL_SIDE_CHANNEL_HOST = the node's IP), and a fixed key would put replicas on one port. "
            f"Move the base with experimental_configs[{PORT_BASE_KEY!r}] instead"
        )


def kv_transfer_config(role: str, transport: str = "nixl", extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `kv_transfer_config` for one side's `engine_kwargs` in Ray's PD app."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)} in Ray Serve LLM's PD app; got {role!r}")
    if transport not in CONNECTORS:
        raise ValueError(f"transport must be one of {', '.join(CONNECTORS)}; got {transport!r}")
    check_extra(extra)
    name, module_path = CONNECTORS[transport]
    config: dict[str, Any] = {"kv_connector": name, "kv_role": role}
    if module_path:
        config["kv_connector_module_path"] = module_path
    if extra:
        config["kv_connector_extra_config"] = dict(extra)
    return config


def llm_config(
    role: str,
    model_id: str,
    model_source: str | None = None,
    *,
    transport: str = "nixl",
    extra: Mapping[str, Any] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    port_base: int | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """One side's LLMConfig as a dict (Ray validates it): the model, `engine_kwargs` with our
    `kv_transfer_config`, and the side-channel port base. `fields`: other LLMConfig fields
    (deployment_config, accelerator_config, placement_group_config, runtime_env, ...)."""
    kwargs = copy.deepcopy(dict(engine_kwargs or {}))
    if "kv_transfer_config" in kwargs:
        raise ValueError("engine_kwargs carries its own kv_transfer_config: pass transport and extra instead")
    kwargs["kv_transfer_config"] = kv_transfer_config(role, transport, extra)
    experimental = dict(fields.pop("experimental_configs", None) or {})
    experimental.setdefault(PORT_BASE_KEY, PORT_BASES[role] if port_base is None else port_base)
    loading = {"model_id": model_id, **({"model_source": model_source} if model_source else {})}
    return {"model_loading_config": loading, "engine_kwargs": kwargs, "experimental_configs": experimental, **fields}


def pd_serving_args(
    model_id: str,
    model_source: str | None = None,
    *,
    transport: str = "nixl",
    prefill_extra: Mapping[str, Any] | None = None,
    decode_extra: Mapping[str, Any] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The argument of `ray.serve.llm.build_pd_openai_app`: P and D on one model with our connector
    (the same engine_kwargs and LLMConfig fields on both sides)."""
    common = dict(transport=transport, engine_kwargs=engine_kwargs, **fields)
    return {
        "prefill_config": llm_config("kv_producer", model_id, model_source, extra=prefill_extra, **common),
        "decode_config": llm_config("kv_consumer", model_id, model_source, extra=decode_extra, **common),
    }


def needs_registration(config: Mapping[str, Any]) -> bool:
    """Whether a kv_transfer_config names a connector of ours that Ray's factory does not know."""
    return config.get("kv_connector") in BACKEND_NAMES


def register_backends(names: tuple[str, ...] = BACKEND_NAMES) -> list[str]:
    """Register KvcConnectorBackend with Ray Serve LLM's connector factory under our connector names
    (in the driver, before serve.run: Ray's registry reaches every replica). Returns the names
    registered now; a name already registered is left as it is."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory as factory

    done = []
    for name in names:
        if not factory.is_registered(name):
            factory.register_backend(name, BACKEND_PATH)
            done.append(name)
    return done


def _backend_class() -> type:
    from ray.llm._internal.serve.engines.vllm.kv_transfer.nixl import NixlConnectorBackend

    class KvcConnectorBackend(NixlConnectorBackend):  # type: ignore[misc]
        """Ray's NixlConnectorBackend set-up (per-replica VLLM_NIXL_SIDE_CHANNEL_PORT / _HOST, a
        unique engine_id) and request shaping, for our connector names; refuses fixed side-channel
        keys first."""

        def setup(self) -> None:
            check_extra(self.kv_transfer_config.get("kv_connector_extra_config"))
            super().setup()

    KvcConnectorBackend.__module__ = __name__
    KvcConnectorBackend.__qualname__ = "KvcConnectorBackend"
    return KvcConnectorBackend


_LAZY: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """`KvcConnectorBackend` is built on first access, subclassing Ray's NIXL backend (imports Ray)."""
    if name != "KvcConnectorBackend":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _LAZY:
        _LAZY[name] = _backend_class()
    return _LAZY[name]
