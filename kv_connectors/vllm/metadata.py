"""Scheduler -> worker metadata for one step: what to load, what to hold, what to release or fail."""

from __future__ import annotations

import dataclasses

from kv_connectors.vllm.compat import KVConnectorMetadata


@dataclasses.dataclass(frozen=True)
class RecvSpec:
    """D: load remote_block_ids of the peer into local_block_ids, then tell P it may free them.

    report=False for releases the scheduler does not wait on (request aborted before it was
    scheduled, or every block was a local prefix hit): only P is told.
    """

    peer_key: tuple[str, str, int]  # (engine id, side-channel host, port)
    remote_request_id: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    report: bool = True


@dataclasses.dataclass
class ConnectorMetadata(KVConnectorMetadata):
    """Built by the scheduler side each step; consumed once by the worker side."""

    reqs_to_recv: dict[str, RecvSpec] = dataclasses.field(default_factory=dict)
    reqs_to_send: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # request id -> blocks held
    reqs_failed: dict[str, str] = dataclasses.field(default_factory=dict)  # request id -> reason
