"""The module path users write: `{"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connectors.mooncake"}`.

The Mooncake backend's face. `MooncakeConnector` (the vLLM adapter's class, kv_connectors/vllm/connector.py)
is resolved on first access, so importing the backend's modules imports no vLLM: `transport.py`
(MooncakeTransport, the Transport Protocol on the Transfer Engine), `peer.py` (a thread per peer running
its batches), `xfer.py` (the transfer handle), `engine.py` (mooncake.engine loaded on first use),
`metadata.py` (the handshake's and notifications' bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_connectors.vllm.connector import MooncakeConnector

__all__ = ["MooncakeConnector"]


def __getattr__(name: str) -> Any:
    """vLLM's `getattr(importlib.import_module("kv_connectors.mooncake"), "MooncakeConnector")` lands here."""
    if name == "MooncakeConnector":
        from kv_connectors.vllm.connector import MooncakeConnector

        return MooncakeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
