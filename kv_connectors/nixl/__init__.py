"""The module path users write: `{"kv_connector": "NixlConnector", "kv_connector_module_path": "kv_connectors.nixl"}`.

The NIXL backend's face. `NixlConnector` (the vLLM adapter's class, kv_connectors/vllm/connector.py)
is resolved on first access, so importing the backend's modules imports no vLLM: `transport.py`
(NixlTransport, the Transport Protocol on nixl_agent), `agent.py` (NIXL loaded on first use, agents
whose progress thread sleeps), `ucx.py` (UCX environment defaults), `metadata.py` (the handshake's bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_connectors.vllm.connector import NixlConnector

__all__ = ["NixlConnector"]


def __getattr__(name: str) -> Any:
    """vLLM's `getattr(importlib.import_module("kv_connectors.nixl"), "NixlConnector")` lands here."""
    if name == "NixlConnector":
        from kv_connectors.vllm.connector import NixlConnector

        return NixlConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
