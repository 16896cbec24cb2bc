"""The worker's counters (kv_connectors.counters) as of now, and the durations kept since they were
last taken, read from its parts."""

from __future__ import annotations

from kv_connectors import wire
from kv_connectors.assembly import Parts, Where
from kv_connectors.counters import Phase


def snapshot(where: Where, parts: Parts, idle_steps: int, directory: tuple[str, ...] = ()) -> wire.StatsReply:
    t, leases, sender = parts.receiver.totals, parts.sender.leases, parts.sender
    settling, quarantined, quarantined_bytes = parts.receiver.settling()
    return wire.StatsReply(
        engine_id=where.cfg.engine_id,
        rank=where.rank,
        tp_size=where.tp_size,
        ranks=directory,
        held_requests=leases.held_requests,
        held_blocks=leases.held_blocks,
        completed_sends=leases.completed,
        expired_leases=leases.expired,
        recv_transfers=t.transfers,
        recv_failures=t.failures,
        recv_bytes=t.bytes,
        recv_blocks=t.blocks,
        recv_descriptors=t.descriptors,
        recv_seconds=t.seconds,
        pushes=sender.pushes,
        layerwise_pushes=sender.layerwise_pushes,
        push_failures=sender.push_failures,
        claims_granted=leases.claims_granted,
        claims_refused=leases.claims_refused,
        stale_reads_refused=parts.receiver.claims_refused,
        reads_fenced_by_words=parts.receiver.fenced_by_words,
        lease_renewals=parts.renewer.renewals,
        idle_steps=idle_steps,
        settled_loads=t.settled,
        settling_loads=settling,
        quarantined_loads=quarantined,
        quarantined_bytes=quarantined_bytes,
        **_staging_stats(parts),
    )


def _staging_stats(parts: Parts) -> dict[str, int]:
    if parts.staging is None:
        return {}
    ps = parts.staging.pool_stats()
    return {
        "staging_pool_bytes": int(ps["pool_bytes"]),
        "staging_peak_bytes": int(ps["peak_slots_in_use"]) * int(ps["chunk_bytes"]),
        "staging_allocated_bytes": int(ps.get("allocated_bytes", ps["pool_bytes"])),
        "staging_quarantined_bytes": int(ps["quarantined_bytes"]),
        "staging_suspect_peers": int(ps["suspect_peers"]),
        "staged_transfers": int(ps["staged_posts"]),
        "direct_transfers": int(ps["direct_posts"]),
    }


def take_load_durations(parts: Parts) -> list[float]:
    """Each completed load's duration since the last call (for the load-time histogram)."""
    totals = parts.receiver.totals
    durations, totals.durations = totals.durations, []
    return durations


def take_phase_durations(parts: Parts) -> dict[Phase, list[float]]:
    """Each phase's durations since the last call (kv_connectors.counters.Phase), for histograms."""
    totals = parts.receiver.totals
    phases, totals.phases = totals.phases, {}
    holds = parts.sender.leases.take_hold_seconds()
    if holds:
        phases[Phase.LEASE_HOLD] = holds
    return phases
