"""Scheduler -> worker metadata for one step, as vLLM carries it (KVConnectorMetadata)."""

from __future__ import annotations

import dataclasses

from kv_connectors.specs import RecvSpec, SendSpec, StepMetadata
from kv_connectors.vllm.compat import KVConnectorMetadata

__all__ = ["ConnectorMetadata", "RecvSpec", "SendSpec"]


@dataclasses.dataclass
class ConnectorMetadata(StepMetadata, KVConnectorMetadata):
    """StepMetadata in the type vLLM passes from the scheduler to the worker."""
