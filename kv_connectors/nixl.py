"""The module path users write: `{"kv_connector": "NixlConnector", "kv_connector_module_path": "kv_connectors.nixl"}`.

A connector face only: importing it imports vLLM (through the adapter). The transport itself is
`kv_connectors.transports.nixl`, which imports no vLLM.
"""

from kv_connectors.vllm.connector import NixlConnector

__all__ = ["NixlConnector"]
