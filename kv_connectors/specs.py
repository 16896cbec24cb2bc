"""What the scheduler side tells the worker side each step (pure: no vLLM types).

The vLLM adapter's ConnectorMetadata is this plus vLLM's KVConnectorMetadata base."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from kv_connectors.plan import TokenRange


class ProducerAddress(NamedTuple):
    """A producer rank's side channel: its engine id ("" for whichever answers there), host, port."""

    engine_id: str
    host: str
    port: int

    @property
    def where(self) -> tuple[str, int]:
        """The address alone: one lane to whichever engine answers there."""
        return (self.host, self.port)


@dataclasses.dataclass(frozen=True)
class RecvSpec:
    """D: load remote_block_ids of the peer into local_block_ids, then tell P it may free them.

    Empty remote_block_ids with local blocks (the transfer-id flow): P's blocks are unknown
    here, so P is asked to write into local_block_ids. report=False for releases the scheduler
    does not wait on (request aborted before it was scheduled, or every block was a local
    prefix hit): only P is told.
    """

    peer_key: ProducerAddress  # P's rank 0
    remote_request_id: str  # the key P holds the blocks under (its request id or the transfer id)
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    report: bool = True
    queued_s: float = 0.0  # how long the request waited in D's queue before this load was scheduled
    # P's tensor-parallel size when its params state it (None: assume ours; the handshake checks):
    # each D rank reads from the P ranks holding its heads.
    remote_tp_size: int | None = None
    # The prompt tokens the load covers (none: whole blocks, paired one to one); remote_block_ids[0]
    # begins at tokens.src_start, local_block_ids[0] at tokens.dst_start (they differ where P's block
    # size differs from D's).
    tokens: TokenRange = TokenRange()
    # params.prompt_digest of the prompt tokens P's KV covers: a push request carries it, and P
    # writes only if its own prompt has that digest ("" where none was computed: not checked).
    prompt_digest: str = ""
    # A hybrid's local blocks per KV cache group (local_block_ids side by side, kv_connectors.groups):
    # a push request carries them and P pairs its own group by group; () for one group.
    group_sizes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SendSpec:
    """P: blocks of a finished prefill, held for a D under `key` (the request id or the transfer id).

    cancelled: the prefill did not finish normally (aborted) but layer-wise writes from these
    blocks may be in flight; hold them until those settle, then tell D it failed.
    prompt_digest: params.prompt_digest of the prefill's prompt: P writes these blocks only into a
    D request whose push request states the same ("" where P has no token ids: not checked).
    group_sizes: a hybrid's blocks per KV cache group; () for one group.
    """

    block_ids: tuple[int, ...]
    key: str
    cancelled: bool = False
    prompt_digest: str = ""
    group_sizes: tuple[int, ...] = ()  # a hybrid's blocks per KV cache group (block_ids side by side)


@dataclasses.dataclass
class StepMetadata:
    """Built by the scheduler side each step; consumed once by the worker side."""

    reqs_to_recv: dict[str, RecvSpec] = dataclasses.field(default_factory=dict)
    reqs_to_send: dict[str, SendSpec] = dataclasses.field(default_factory=dict)  # request id -> blocks held
    reqs_failed: dict[str, str] = dataclasses.field(default_factory=dict)  # request id -> reason
    # P: prefills this step completes whose D may already be waiting (transfer-id flow):
    # their layers can be written as soon as each is computed.
    reqs_layerwise: dict[str, SendSpec] = dataclasses.field(default_factory=dict)
    # P: transfer ids whose prefill ended without KV to send (aborted): D is told at once.
    transfers_cancelled: dict[str, str] = dataclasses.field(default_factory=dict)
    # D: requests queued long enough that P's lease needs heartbeats: request id -> (P's
    # side-channel key, the key P holds the blocks under, P's TP size if stated); and those that left the queue.
    renew_start: dict[str, tuple[ProducerAddress, str, int | None]] = dataclasses.field(default_factory=dict)
    renew_stop: set[str] = dataclasses.field(default_factory=set)
    # The step schedules no token: the worker may wait briefly for its next event (kv_connectors.idle).
    idle: bool = False

    def has_work(self) -> bool:
        """Whether the step brings the worker anything (most decode steps bring nothing)."""
        return bool(
            self.reqs_to_recv
            or self.reqs_to_send
            or self.reqs_failed
            or self.reqs_layerwise
            or self.transfers_cancelled
            or self.renew_start
            or self.renew_stop
        )
