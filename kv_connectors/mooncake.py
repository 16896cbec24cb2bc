"""The module path users write: `{"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connectors.mooncake"}`.

A connector face only: importing it imports vLLM (through the adapter). The transport itself is
`kv_connectors.transports.mooncake`, which imports no vLLM.
"""

from kv_connectors.vllm.connector import MooncakeConnector

__all__ = ["MooncakeConnector"]
