"""NIXL connector for vLLM: `{"kv_connector": "NixlConnector", "kv_connector_module_path": "kv_connectors.nixl"}`."""

from __future__ import annotations

from typing import Any

from kv_connectors.vllm.connector import KVConnector


class NixlConnector(KVConnector):
    """KV transfer over NIXL (UCX): D reads P's blocks (pull)."""

    transport_name = "nixl"

    def make_transport(self, name: str) -> Any:
        from kv_connectors.nixl.transport import NixlTransport

        return NixlTransport(name, backend=self._cfg.nixl_backend, progress_delay_us=self._cfg.progress_delay_us)


__all__ = ["NixlConnector"]
