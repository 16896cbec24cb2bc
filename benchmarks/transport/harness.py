"""What the transport benchmarks (bench_transport, bench_staging) share: the engine flags, one side of
a benchmark as a kvc_testing.peers.PeerSpec, this process's side (D) opened over its KV cache, P
started in its own process, and the block tables a run moves."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from kv_connectors.layout import KVLayout
from kv_connectors.transports.base import Transport
from kvc_testing import peers
from kvc_testing.kvbuffers import Shape
from kvc_testing.peers import Peer, PeerSpec

START_TIMEOUT_S = 120.0


def add_engine_args(ap: argparse.ArgumentParser, poll_us: float) -> None:
    """The engine knobs engine_spec reads, and the sleep between polls."""
    ap.add_argument("--progress-delay-us", type=int, default=1000, help="NIXL only: progress-thread delay")
    ap.add_argument(
        "--num-threads", type=int, default=None, help="NIXL only: UCX worker threads (default: the connector's, 4; 0: inline copy)"
    )
    ap.add_argument("--max-batch", type=int, default=1000, help="Mooncake only: runs per engine batch")
    ap.add_argument("--mooncake-protocol", default="tcp", help="Mooncake only: engine protocol")
    ap.add_argument("--poll-us", type=float, default=poll_us, help="sleep between polls (0: spin)")


def engine_spec(args: argparse.Namespace, name: str, shape: Shape, fill: str, pool: int = 0, chunk: int = 0) -> PeerSpec:
    """One side of a benchmark in the shared harness: args.transport with the engine knobs, the
    benchmark KV pattern ("pattern") or sentinels ("sentinel") on args.device, staged where pool > 0
    (a staging P takes part in every chunk, so it progresses every poll; a plain one every 10 ms)."""
    if args.transport not in ("nixl", "mooncake"):
        raise SystemExit(f"unknown transport {args.transport!r}")
    return PeerSpec(
        args.transport,
        name,
        pool=pool,
        chunk=chunk,
        probe_s=1.0,
        progress_delay_us=args.progress_delay_us,
        num_threads=args.num_threads,
        max_batch=args.max_batch,
        protocol=args.mooncake_protocol,
        shape=shape,
        device=getattr(args, "device", "cpu"),
        fill=fill,
        idle=args.poll_us / 1e6 if pool else 0.01,
        digest_notifs=False,
    )


def open_side(spec: PeerSpec) -> tuple[Transport, list[Any], KVLayout]:
    """This process's side: the spec's transport, registered over its KV cache."""
    kv, layout = peers.kv_of(spec)
    transport = peers.open_transport(spec)
    try:
        transport.register(layout, spec.memory_kind, 0)
    except BaseException:
        transport.close()
        raise
    return transport, kv, layout


def start_p(spec: PeerSpec, timeout_s: float = START_TIMEOUT_S) -> Peer:
    """P in its own process (kvc_testing.peers.serve), ready; timeout_s bounds its start and every answer."""
    try:
        return peers.start_peers([spec], wait_s=timeout_s, startup_s=timeout_s)[0]
    except TimeoutError as e:
        raise SystemExit(f"P did not start: {e}") from e


def block_ids(order: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if order == "sequential":
        return np.arange(n), np.arange(n)
    # A real block table: P's and D's allocators each hand out their own free blocks, so the
    # remote (source) and local (destination) ids are two independent permutations.
    rng = np.random.default_rng(seed)
    return rng.permutation(n), rng.permutation(n)
