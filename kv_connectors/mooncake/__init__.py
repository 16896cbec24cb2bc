"""Mooncake connector for vLLM: `{"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connectors.mooncake"}`.

Import-light: `kv_connectors.mooncake.transport` does not pull in vLLM; the connector class (which
does) is built on first access.
"""

from __future__ import annotations

from typing import Any

from kv_connectors.lazy import lazy_attribute

__all__ = ["MooncakeConnector"]


def _build_connector_class() -> type:
    from kv_connectors.vllm.connector import KVConnector

    class MooncakeConnector(KVConnector):
        """KV transfer over the Mooncake Transfer Engine (P2PHANDSHAKE, tcp or rdma); P pushes by default."""

        transport_name = "mooncake"
        default_extra_config = {"mode": "push"}

        def make_transport(self, name: str) -> Any:
            from kv_connectors.transports import create_transport

            return create_transport("mooncake", name, self._cfg)

    MooncakeConnector.__module__ = __name__
    MooncakeConnector.__qualname__ = "MooncakeConnector"
    return MooncakeConnector


__getattr__ = lazy_attribute(globals(), "MooncakeConnector", _build_connector_class)
