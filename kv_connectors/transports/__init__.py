"""Transports by kind: one registry, `create_transport`, used by the connectors, benchmarks and tests.

Engines are imported lazily, so naming one that is not installed says which extra to install.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from kv_connectors.config import ConnectorConfig
from kv_connectors.errors import ConfigError
from kv_connectors.transports.base import Transport

KINDS = ("nixl", "mooncake", "memory")


def create_transport(kind: str, name: str, cfg: ConnectorConfig, **kwargs: Any) -> Transport:
    """A transport named `name` (its agent name) of `kind`, set up from the connector config.

    kwargs go to the transport (the memory transport needs `fabric`)."""
    if kind == "nixl":
        nixl = _engine(*_ENGINES["nixl"], "nixl")
        return nixl(
            name,
            backend=cfg.nixl_backend,
            progress_delay_us=cfg.progress_delay_us,
            num_threads=cfg.nixl_num_threads or None,
            **kwargs,
        )
    if kind == "mooncake":
        mooncake = _engine(*_ENGINES["mooncake"], "mooncake")
        return mooncake(
            name, hostname=cfg.side_channel_host, protocol=cfg.mooncake_protocol, device_name=cfg.mooncake_device_name, **kwargs
        )
    if kind == "memory":
        from kv_connectors.transports.memory import MemoryTransport

        return MemoryTransport(name, **kwargs)
    raise ConfigError(f"unknown transport {kind!r}; known: {', '.join(KINDS)}")


_ENGINES = {
    "nixl": ("kv_connectors.nixl.transport", "NixlTransport"),
    "mooncake": ("kv_connectors.mooncake.transport", "MooncakeTransport"),
}


def require_transport(kind: str) -> None:
    """What building a transport of `kind` would refuse first, without building one: an unknown kind,
    or an engine that is not installed (ConfigError naming the pip extra)."""
    if kind == "memory":
        return
    if kind not in _ENGINES:
        raise ConfigError(f"unknown transport {kind!r}; known: {', '.join(KINDS)}")
    _engine(*_ENGINES[kind], kind)


def _engine(module: str, cls: str, extra: str) -> Callable[..., Transport]:
    """A transport class whose engine is an optional dependency; a missing one names the pip extra."""
    try:
        factory: Callable[..., Transport] = getattr(importlib.import_module(module), cls)
        return factory
    except ImportError as e:
        raise ConfigError(f"the {extra} transport needs `pip install kv-connectors[{extra}]`: {e}") from e


@contextlib.contextmanager
def ucx_on_loopback() -> Iterator[None]:
    """Peers on this host (probes, tests, benchmarks): UCX on loopback while inside, for this
    process and the ones it spawns; a UCX_NET_DEVICES the user set is kept."""
    old = os.environ.get("UCX_NET_DEVICES")
    os.environ["UCX_NET_DEVICES"] = old or "lo"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("UCX_NET_DEVICES", None)
