"""Every counter the worker engine keeps, defined once.

`Counters` declares each one: its name (the field), its kind (a cumulative counter or a
point-in-time gauge) and its help text (in the field's `msgspec.Meta`). Everything else is
derived from it: the side channel's `wire.StatsReply` is `Counters` plus the engine id; the
table `COUNTERS` below lists them for the vLLM adapter, which builds `KvcStats` (per-interval
increments and gauges) and the `kvc:<name>` Prometheus metrics from it. Adding a counter here
adds it everywhere; its producer sets it in `kv_connectors.snapshot`.

Every value defaults to 0: a peer of an earlier release that lacks a newer counter still decodes.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Annotated

import msgspec


class Kind(enum.Enum):
    COUNTER = "counter"  # cumulative: reported as per-interval increments; a Prometheus counter
    GAUGE = "gauge"  # point in time: the latest value wins; a Prometheus gauge


def _counter(help_text: str, *, metric: bool = True) -> msgspec.Meta:
    return msgspec.Meta(description=help_text, extra={"kind": Kind.COUNTER, "metric": metric})


def _gauge(help_text: str) -> msgspec.Meta:
    return msgspec.Meta(description=help_text, extra={"kind": Kind.GAUGE, "metric": True})


class Counters(msgspec.Struct, frozen=True):
    """The engine's counters, cumulative since it started (gauges: as of the snapshot)."""

    held_requests: Annotated[int, _gauge("Requests whose KV blocks this (prefill) instance holds for a decode instance.")] = 0
    held_blocks: Annotated[int, _gauge("KV blocks this (prefill) instance holds for decode instances.")] = 0
    completed_sends: Annotated[int, _counter("Requests whose blocks a decode instance was done with (freed on notice).")] = 0
    expired_leases: Annotated[int, _counter("Requests whose blocks were freed because no decode instance came for them.")] = 0
    recv_transfers: Annotated[int, _counter("KV loads completed on this (decode) instance.")] = 0
    recv_failures: Annotated[int, _counter("KV loads that failed on this (decode) instance.")] = 0
    recv_bytes: Annotated[int, _counter("Bytes of KV loaded into this instance.")] = 0
    recv_blocks: Annotated[int, _counter("KV blocks loaded into this instance.")] = 0
    recv_descriptors: Annotated[int, _counter("Transfer descriptors (coalesced byte runs) of the KV loads.")] = 0
    # Not a metric of its own: the load-time histogram (kvc:transfer_seconds) has each load's duration.
    recv_seconds: Annotated[float, _counter("Seconds the completed KV loads took, summed.", metric=False)] = 0.0
    pushes: Annotated[int, _counter("Pushes written from this (prefill) instance into a decode instance's blocks.")] = 0
    push_failures: Annotated[int, _counter("Pushes from this instance that failed.")] = 0
    layerwise_pushes: Annotated[int, _counter("Pushes written layer by layer during the prefill's forward pass.")] = 0
    staging_pool_bytes: Annotated[int, _gauge("Configured size of the CPU staging pool (0: no staging).")] = 0
    staging_peak_bytes: Annotated[int, _gauge("Most staging-pool bytes in use at once.")] = 0
    staging_allocated_bytes: Annotated[int, _gauge("Staging-pool bytes actually allocated.")] = 0
    staging_quarantined_bytes: Annotated[
        int,
        _gauge("Staging-pool bytes no one may be given: held for suspect peers, or under a failed transfer not ended yet."),
    ] = 0
    staging_suspect_peers: Annotated[int, _gauge("Staging peers that stopped answering (their slots quarantined).")] = 0
    staged_transfers: Annotated[int, _counter("Transfers this instance started through its staging pool.")] = 0
    direct_transfers: Annotated[
        int, _counter("Transfers a fragmented staging transport started directly (a plan of few or long runs).")
    ] = 0
    claims_granted: Annotated[int, _counter("Reads of this (prefill) instance's blocks confirmed under a live lease.")] = 0
    claims_refused: Annotated[
        int, _counter("Reads of this (prefill) instance's blocks refused: lease ended, or blocks not held.")
    ] = 0
    reads_fenced_by_words: Annotated[
        int,
        _counter("KV loads this (decode) instance confirmed by reading the prefill's lease words (no claim round trip)."),
    ] = 0
    stale_reads_refused: Annotated[
        int, _counter("KV loads this (decode) instance failed because the prefill side refused the claim.")
    ] = 0
    lease_renewals: Annotated[
        int, _counter("Prefill leases this (decode) instance kept alive for requests waiting in its queue.")
    ] = 0
    settled_loads: Annotated[
        int,
        _counter("Failed KV loads reported only after their transfer settled (an operation was still in flight)."),
    ] = 0
    settling_loads: Annotated[
        int, _gauge("Failed KV loads waiting for their transfer to settle before vLLM is told (their blocks held).")
    ] = 0
    quarantined_loads: Annotated[
        int, _gauge("Settling KV loads past settle_timeout_s: their transfer has not ended; the blocks stay held.")
    ] = 0
    quarantined_bytes: Annotated[int, _gauge("KV bytes held by quarantined loads.")] = 0
    idle_steps: Annotated[
        int, _counter("Engine steps that scheduled no token while requests waited on the connector (each may wait briefly).")
    ] = 0
    requests_without_params: Annotated[
        int,
        _counter(
            "Requests that reached this decode-only instance (kv_consumer) without a prefill instance's kv_transfer_params: "
            "computed here, no KV loaded (the scheduler side counts them: on /metrics, 0 in the side channel's stats)."
        ),
    ] = 0


@dataclasses.dataclass(frozen=True)
class Counter:
    """One entry of the table derived from `Counters`."""

    name: str  # the StatsReply field, the KvcStats key, and the metric kvc:<name>
    kind: Kind
    help: str
    metric: bool  # exported to vLLM's stats and Prometheus


def _table() -> tuple[Counter, ...]:
    entries = []
    for field in msgspec.structs.fields(Counters):
        meta = next(m for m in typing.get_args(field.type)[1:] if isinstance(m, msgspec.Meta))
        assert meta.extra is not None and meta.description is not None, field.name
        entries.append(Counter(field.name, meta.extra["kind"], meta.description, meta.extra["metric"]))
    return tuple(entries)


COUNTERS: tuple[Counter, ...] = _table()


def metrics(kind: Kind) -> dict[str, str]:
    """Exported counters of one kind: name -> help, in definition order."""
    return {c.name: c.help for c in COUNTERS if c.kind is kind and c.metric}


DURATIONS_CAP = 10_000  # durations kept per kind until taken for metrics (bounded when nobody takes them)


class Phase(enum.Enum):
    """Durations kept per transfer, each a `kvc:<value>_seconds` histogram. D's phases of one load:
    queue (arrival at D until the load starts), handshake (load start until the read or push
    request is posted, ~0 with a known peer), then transfer (post until the load counts; the
    existing `kvc:transfer_seconds`), within which read (post until the bytes landed; push: until
    P's notice) and claim (the fence, pull: the lease words' read, or the claim's round trip);
    total = handshake + transfer. A load that waited on its producer's handshake also keeps the
    handshake's parts: reply (request until the answer), pickup (answer until the engine thread took
    it) and connect (the transport's connect). P: lease hold (blocks held for a D, from the end of
    the prefill until freed or expired)."""

    QUEUE = "load_queue"
    HANDSHAKE = "load_handshake"
    HANDSHAKE_REPLY = "load_handshake_reply"
    HANDSHAKE_PICKUP = "load_handshake_pickup"
    HANDSHAKE_CONNECT = "load_handshake_connect"
    CLAIM = "load_claim"
    READ = "load_read"
    TOTAL = "load_total"
    SETTLE = "load_settle"
    LEASE_HOLD = "lease_hold"


PHASE_HELP: dict[Phase, str] = {
    Phase.QUEUE: "Decode: time a request waited in the decode instance's queue before its KV load started.",
    Phase.HANDSHAKE: "Decode: from the KV load's start until its read (or push request) was posted (the handshake).",
    Phase.HANDSHAKE_REPLY: "Decode: a handshake a KV load waited on, from its request until the producer's answer arrived.",
    Phase.HANDSHAKE_PICKUP: "Decode: a handshake a KV load waited on, from the producer's answer until D's engine took it.",
    Phase.HANDSHAKE_CONNECT: "Decode: a handshake a KV load waited on, the transport's connect to the producer.",
    Phase.CLAIM: "Decode, pull: the fence (the lease words' read after the data, or the lease claim's round trip).",
    Phase.READ: "Decode: from post until the KV bytes landed (push: until the prefill instance's notice).",
    Phase.TOTAL: "Decode: from the KV load's start until it counted (handshake + transfer).",
    Phase.SETTLE: "Decode: from a KV load's failure until its transfer settled (no byte of it could land any more).",
    Phase.LEASE_HOLD: "Prefill: how long KV blocks were held for a decode instance (until freed or expired).",
}
