"""vLLM plugin entry point: registers our connector names with vLLM's KV connector factory (idempotent)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Our names never collide with vLLM's built-ins (NixlConnector, MooncakeConnector, ...).
CONNECTORS: dict[str, tuple[str, str]] = {
    "KvcNixlConnector": ("kv_connectors.vllm.connector", "NixlConnector"),
    "KvcMooncakeConnector": ("kv_connectors.vllm.connector", "MooncakeConnector"),
}


def register() -> None:
    """Called once per vLLM process (API server, EngineCore, Worker); safe to call again."""
    from kv_connectors.vllm import compat  # the one place that imports vLLM

    for name, (module, cls) in CONNECTORS.items():
        if not compat.register_connector(name, module, cls):
            logger.debug("connector %s already registered", name)
