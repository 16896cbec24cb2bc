"""NIXL connector for vLLM: `{"kv_connector": "NixlConnector", "kv_connector_module_path": "kv_connectors.nixl"}`.

Import-light: `kv_connectors.nixl.transport` does not pull in vLLM; the connector class (which does)
is built on first access.
"""

from __future__ import annotations

from typing import Any

from kv_connectors.lazy import lazy_attribute

__all__ = ["NixlConnector"]


def _build_connector_class() -> type:
    from kv_connectors.vllm.connector import KVConnector

    class NixlConnector(KVConnector):
        """KV transfer over NIXL (UCX): D reads P's blocks (pull)."""

        transport_name = "nixl"

        def make_transport(self, name: str) -> Any:
            from kv_connectors.transports import create_transport

            return create_transport("nixl", name, self._cfg)

    NixlConnector.__module__ = __name__
    NixlConnector.__qualname__ = "NixlConnector"
    return NixlConnector


__getattr__ = lazy_attribute(globals(), "NixlConnector", _build_connector_class)
