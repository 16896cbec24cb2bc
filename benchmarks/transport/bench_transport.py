"""Transport throughput: D pulls N MiB of KV blocks from P (two processes), compared with one-thread memcpy."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from benchmarks.transport import kernel
from benchmarks.transport.harness import add_engine_args, block_ids, engine_spec, open_side, start_p
from kv_connectors.config import ConnectorConfig, parse_config
from kv_connectors.errors import ConfigError
from kv_connectors.plan import BlockTable, TransferPlan, plan_blocks, plan_cells
from kv_connectors.tp import rank_heads, source_ranks
from kv_connectors.transports.base import Transport, XferState
from kv_connectors.transports.staging.direct import FragmentRule
from kvc_testing import netns, peers
from kvc_testing.kvbuffers import (
    F32,
    HEAD_DIM_X2,
    Shape,
    bench_kv,
    check_heads,
    check_pattern,
    check_tokens,
    fill_pattern,
    fill_sentinel,
)
from kvc_testing.peers import Peer

logger = logging.getLogger(__name__)

XFER_TIMEOUT_S = 120.0


def wait_notifs(p: Peer, expected: int, timeout: float = 10.0) -> int:
    """Notifications P received (one per full read), waiting up to timeout for `expected`; -1 if P does not answer."""
    deadline = time.monotonic() + timeout
    received = 0
    while True:
        try:
            received += len(p.call("notifs", timeout=timeout))
        except (TimeoutError, OSError, EOFError):
            return -1
        if received >= expected or time.monotonic() >= deadline:
            return received
        time.sleep(0.01)


def run_xfer(
    t: Transport, plan: TransferPlan, poll_s: float, notif: bytes, batches: list[int] | None = None, write: bool = False
) -> float:
    """One READ from (or WRITE into) the other process; seconds from post to DONE. Appends the
    engine batches used (if known) to batches."""
    start = time.perf_counter()
    handle = t.post_write("bench-p", plan, notif) if write else t.post_read("bench-p", plan, notif)
    if batches is not None:
        batches.append(getattr(handle, "num_batches", 1))
    try:
        while t.poll(handle) is XferState.IN_PROGRESS:
            if time.perf_counter() - start > XFER_TIMEOUT_S:
                raise SystemExit(f"transfer did not finish within {XFER_TIMEOUT_S} s")
            time.sleep(poll_s)
        return time.perf_counter() - start
    finally:
        t.release(handle)


def time_plan(planned: Any, s: np.ndarray, d: np.ndarray) -> tuple[TransferPlan, float]:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        plan = planned(s, d)
        best = min(best, time.perf_counter() - t0)
    return plan, best


def memcpy_gbps(nbytes: int, repeat: int) -> list[float]:
    """The same bytes as one contiguous numpy.copyto (a single-thread memcpy), prefaulted buffers."""
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.full(nbytes, 0, dtype=np.uint8)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def _tcp_sender(address: str, port: int, nbytes: int, repeat: int, namespace: str = "") -> None:
    """The other process of the raw TCP baseline: sends nbytes, repeat times, from one buffer (from
    P's network namespace with --two-hosts)."""
    if namespace:
        netns.enter(namespace)
    data = memoryview(np.full(nbytes, 7, dtype=np.uint8))
    with socket.create_connection((address, port)) as s:
        for _ in range(repeat):
            s.sendall(data)
            s.recv(1)  # the receiver's go-ahead: each repeat is timed alone


def tcp_gbps(nbytes: int, repeat: int, hosts: netns.TwoHosts | None = None) -> list[float]:
    """The same bytes over a plain TCP socket between two processes (sendall/recv_into), on loopback
    or, with hosts, from P's namespace to D's across the veth pairs: what the wire path alone
    delivers here, the yardstick for transports restricted to TCP."""

    ctx = mp.get_context("spawn")
    address = hosts.d.address if hosts else "127.0.0.1"
    with socket.create_server((address, 0)) as server:
        sender = (address, server.getsockname()[1], nbytes, repeat, hosts.p.netns if hosts else "")
        proc = ctx.Process(target=_tcp_sender, args=sender, daemon=True)
        proc.start()
        server.settimeout(60)
        conn, _ = server.accept()
        buf = memoryview(np.zeros(nbytes, dtype=np.uint8))
        out = []
        with conn:
            for _ in range(repeat):
                got, t0 = 0, time.perf_counter()
                while got < nbytes:
                    n = conn.recv_into(buf[got:], nbytes - got)
                    if n == 0:
                        raise SystemExit("raw TCP baseline: the sender closed early")
                    got += n
                out.append(nbytes / (time.perf_counter() - t0) / 1e9)
                conn.sendall(b"k")
        proc.join(30)
    return out


def cma_baseline(pid: int, plan: TransferPlan, push: bool, args: argparse.Namespace) -> dict[str, Any]:
    """The kernel's cross-process copy of the same runs with P's process (benchmarks/transport/kernel.py),
    on one thread and on one per core, and the transport's median against each (ratio_cma*)."""
    if args.staging != "off" or getattr(args, "hosts", None) is not None:
        raise SystemExit("--cma-baseline times the same runs between two processes of one host: not with --staging or --two-hosts")
    cores = len(os.sched_getaffinity(0))  # the CPUs this run may use (--cpus confines it)
    one = kernel.cma_gbps(pid, plan, push, args.repeat)
    many = kernel.cma_gbps(pid, plan, push, args.repeat, threads=cores)
    return {
        "cma_gbps": round(statistics.median(one), 3),
        "cma_threads": cores,
        "cma_gbps_threads": round(statistics.median(many), 3),
    }


def staging_config(args: argparse.Namespace) -> ConnectorConfig:
    """The connector's staging settings for --staging, --pool-mib, --chunk-kib and the fragment
    flags, through its own config parsing: what is not given (0) takes the mode's default."""
    extra: dict[str, Any] = {"staging": args.staging}
    if args.pool_mib:
        extra["staging_pool_kib"] = args.pool_mib << 10
    if args.chunk_kib:
        extra["staging_chunk_kib"] = args.chunk_kib
    if args.staging == "fragmented":
        extra.update(staging_fragment_runs=args.fragment_runs, staging_fragment_kib=args.fragment_kib)
    try:
        return parse_config("bench", "kv_both", extra)
    except ConfigError as e:
        raise SystemExit(str(e)) from None


def tp_shapes(args: argparse.Namespace) -> tuple[Shape, Shape]:
    """(P's, D's) KV caches: P rank holding the first heads D rank args.d_rank reads (of
    args.kv_heads over args.p_tp ranks), D rank holding its own; both with args.block_kib's tokens
    per block, P with args.size_mib."""
    p_rank = source_ranks(args.kv_heads, args.p_tp, args.d_tp, args.d_rank)[0]
    p_first, p_heads = rank_heads(args.kv_heads, args.p_tp, p_rank)
    d_first, d_heads = rank_heads(args.kv_heads, args.d_tp, args.d_rank)
    p_kib = args.block_kib
    if args.p_block:
        p_kib = _kib(args.p_block * p_heads, "--p-block")
    p = Shape(args.size_mib, p_kib, args.layers, p_heads, p_first)
    p.check()
    d_tokens = args.d_block or p.block_size
    d_kib = _kib(d_tokens * d_heads, "--d-block")
    tokens = p.num_blocks * p.block_size
    if tokens % d_tokens or (tokens // d_tokens * d_kib * args.layers) % 1024:
        raise SystemExit("P's tokens must fill whole D blocks and whole MiB")
    d = Shape(tokens // d_tokens * d_kib * args.layers // 1024, d_kib, args.layers, d_heads, d_first)
    return p, d


def _kib(token_heads: int, flag: str) -> int:
    """KiB of a block holding token_heads (tokens x heads) of the benchmark's KV."""
    nbytes = token_heads * HEAD_DIM_X2 * F32
    if nbytes % 1024:
        raise SystemExit(f"{flag}: a block must be whole KiB ({nbytes} bytes)")
    return nbytes // 1024


def homogeneous_counterpart(args: argparse.Namespace) -> argparse.Namespace:
    """The same bytes between ranks that hold the same heads in blocks of the same size: both sides
    at the larger TP size, the D rank holding the heads the heterogeneous read moves, P's cache cut
    to those heads, D's blocks as large as P's."""
    tp = max(args.p_tp, args.d_tp)
    p_shape, d_shape = tp_shapes(args)
    lo = max(p_shape.first_head, d_shape.first_head)
    d_rank = next(r for r in range(tp) if rank_heads(args.kv_heads, tp, r)[0] == lo)
    heads = rank_heads(args.kv_heads, tp, d_rank)[1]
    return argparse.Namespace(
        **{
            **vars(args),
            "p_tp": tp,
            "d_tp": tp,
            "d_rank": d_rank,
            "size_mib": args.size_mib * heads // p_shape.heads,
            "block_kib": args.block_kib * heads // p_shape.heads,
            "d_block": p_shape.block_size if args.d_block else 0,
        }
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    p_shape, d_shape = tp_shapes(args)
    d_shape.check()
    shape = p_shape
    tokens = p_shape.num_blocks * p_shape.block_size
    by_token = p_shape.block_size != d_shape.block_size
    hetero = by_token or (p_shape.heads, p_shape.first_head) != (d_shape.heads, d_shape.first_head)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback between the two processes
    push = args.mode == "push"
    staged = args.staging in ("on", "fragmented")
    if hetero and (push or staged):
        raise SystemExit("different TP or block sizes are benchmarked pulling, without staging (as the connector serves them)")
    cfg = staging_config(args) if staged else None
    pool, chunk = (cfg.staging_pool_kib << 10, cfg.staging_chunk_kib << 10) if cfg is not None else (0, 0)
    # P holds the blocks D reads (pull), or sentinels the other process writes into (push).
    p_spec = engine_spec(args, "bench-p", p_shape, "sentinel" if push else "pattern", pool, chunk)
    d_spec = engine_spec(args, "bench-d", d_shape, "sentinel", pool, chunk)
    if args.staging == "fragmented":
        assert cfg is not None
        rule = FragmentRule(cfg.staging_fragment_runs, cfg.staging_fragment_kib << 10)
        p_spec, d_spec = dataclasses.replace(p_spec, fragments=rule), dataclasses.replace(d_spec, fragments=rule)
    skip = getattr(args, "copies", "real") == "skip"
    if skip and not pool:
        raise SystemExit("--copies skip times the staging pipeline: it needs --staging on")
    if skip:
        p_spec, d_spec = dataclasses.replace(p_spec, copies="skip"), dataclasses.replace(d_spec, copies="skip")
    huge = getattr(args, "huge_pages", "on") == "on"
    p_spec, d_spec = dataclasses.replace(p_spec, huge_pages=huge), dataclasses.replace(d_spec, huge_pages=huge)
    hosts: netns.TwoHosts | None = getattr(args, "hosts", None)
    if hosts is not None:  # --two-hosts: P's process in its namespace; this one (D) is in D's already
        p_spec = dataclasses.replace(p_spec, host=hosts.p.address, netns=hosts.p.netns)
        d_spec = dataclasses.replace(d_spec, host=hosts.d.address)
    transport = None
    p: Peer | None = None
    try:
        # D: every byte marked "not copied" (also prefaults); push fills the pattern below.
        transport, kv, local = open_side(d_spec)
        p = start_p(p_spec)
        transport.connect("bench-p", p.metadata)
        if staged and p.call("connect", "bench-d", transport.local_metadata()) != "ok":
            raise SystemExit("P did not connect back to D (staging)")
        remote = p.layout
        assert remote is not None
        poll_s = args.poll_us / 1e6

        src_layout, dst_layout = (local, remote) if push else (remote, local)

        def ids(order: str) -> tuple[np.ndarray, np.ndarray]:
            if not by_token:
                return block_ids(order, shape.num_blocks, args.seed)
            return block_ids(order, p_shape.num_blocks, args.seed)[0], block_ids(order, d_shape.num_blocks, args.seed + 1)[1]

        def planned(s_ids: Any, d_ids: Any) -> TransferPlan:
            if by_token:
                return plan_cells(src_layout, BlockTable(s_ids), dst_layout, BlockTable(d_ids), 0, tokens)
            return plan_blocks(src_layout, s_ids, dst_layout, d_ids)

        counts = {o: planned(*ids(o)).num_runs for o in ("sequential", "shuffled")}
        src_ids, dst_ids = ids(args.order)
        plan, plan_s = time_plan(planned, src_ids, dst_ids)
        if by_token:  # latency probe: D's first block, from the P blocks holding its tokens
            n = d_shape.block_size
            one = plan_cells(src_layout, BlockTable(range(-(-n // p_shape.block_size))), dst_layout, BlockTable([0]), 0, n)
        else:
            one = plan_blocks(src_layout, [0], dst_layout, [0])  # one block of every layer: latency probe
        if push:
            fill_pattern(kv)
        run_xfer(transport, plan, poll_s, b"warmup", write=push)  # connection set-up, page tables
        if push and not skip:
            answer = p.call("verify", src_ids, dst_ids)
            if answer != "ok":
                raise SystemExit(f"push verification at the receiver failed: {answer}")
        else:
            fill_sentinel(kv)
        batches: list[int] = []
        secs = [run_xfer(transport, plan, poll_s, b"timed", batches, write=push)]
        if not push and not skip:
            if by_token:
                err = check_tokens(kv, d_shape, dst_ids, bench_kv(p_shape, fill="pattern"), p_shape, src_ids)
            elif hetero:
                err = check_heads(kv, src_ids, dst_ids, p_shape, d_shape)
            else:
                err = check_pattern(kv, src_ids, dst_ids)
            if err:
                raise SystemExit(err)
        secs += [run_xfer(transport, plan, poll_s, b"timed", write=push) for _ in range(args.repeat - 1)]
        lat = [run_xfer(transport, one, poll_s, b"", write=push) for _ in range(args.latency_samples)]

        notifs = wait_notifs(p, expected=args.repeat + 1)
        gbps = [plan.total_bytes / s / 1e9 for s in secs]
        mem = memcpy_gbps(plan.total_bytes, args.repeat)
        tcp = tcp_gbps(plan.total_bytes, args.repeat, hosts) if args.tcp_baseline else []
        cma = cma_baseline(p.proc.pid, plan, push, args) if getattr(args, "cma_baseline", False) else {}
        pool_stats = transport.pool_stats() if staged else {}
        return {
            "transport": args.transport,
            "path": "two hosts (network namespaces, veth and bridge)" if hosts else "loopback",
            "op": "WRITE" if push else "READ",
            "mode": args.mode,
            "order": args.order,
            "size_mib": args.size_mib,
            "block_kib": args.block_kib,
            "layers": args.layers,
            "blocks": shape.num_blocks,
            "kv_heads": args.kv_heads,
            "p_tp": args.p_tp,
            "d_tp": args.d_tp,
            "d_rank": args.d_rank,
            "p_heads": [p_shape.first_head, p_shape.heads],
            "d_heads": [d_shape.first_head, d_shape.heads],
            "p_block": p_shape.block_size,
            "d_block": d_shape.block_size,
            "bytes": plan.total_bytes,
            "descriptors": plan.num_runs,
            "runs_per_block": round(plan.num_runs / shape.num_blocks, 3),
            "descriptors_by_order": counts,
            "plan_ms": round(plan_s * 1e3, 3),
            "repeat": args.repeat,
            "gbps": round(statistics.median(gbps), 3),
            "gbps_best": round(max(gbps), 3),
            "memcpy_gbps": round(statistics.median(mem), 3),
            "memcpy_gbps_best": round(max(mem), 3),
            "memcpy": "numpy.copyto of one contiguous buffer (single-thread memcpy)",
            "ratio": round(statistics.median(gbps) / statistics.median(mem), 3),
            **(
                {
                    "tcp_gbps": round(statistics.median(tcp), 3),
                    "tcp_gbps_best": round(max(tcp), 3),
                    "ratio_tcp": round(statistics.median(gbps) / statistics.median(tcp), 3),
                }
                if tcp
                else {}
            ),
            **cma,
            "xfer_ms": round(statistics.median(secs) * 1e3, 3),
            "memcpy_ms": round(plan.total_bytes / statistics.median(mem) / 1e6, 3),
            "latency_us_1block": round(statistics.median(lat) * 1e6, 1) if lat else None,
            "progress_delay_us": args.progress_delay_us if args.transport == "nixl" else None,
            "num_threads": (ConnectorConfig.nixl_num_threads if args.num_threads is None else args.num_threads)
            if args.transport == "nixl"
            else None,
            "batches": batches[0],
            "max_batch": args.max_batch if args.transport == "mooncake" else None,
            "poll_us": args.poll_us,
            "notifs_at_p": notifs,
            "staging": staged,
            "staging_mode": args.staging,
            "pool_mib": pool >> 20 if staged else None,
            "chunk_kib": chunk >> 10 if staged else None,
            "pool_peak_slots": pool_stats["peak_slots_in_use"] if staged else None,
            **({"posts": {k: pool_stats[f"{k}_posts"] for k in ("staged", "direct")}} if staged else {}),
            "verified": not skip,
            "copies": "skip" if skip else "real",
            "huge_pages": huge,
        }
    finally:
        if p is not None:
            peers.stop_peers([p])
        if transport is not None:
            transport.close()


def report(r: dict[str, Any]) -> None:
    how = "WRITE (this process pushes into the other)" if r["mode"] == "push" else "READ (D pulls from P)"
    print(
        f"{r['transport']} {how}, {r['order']}: {r['size_mib']} MiB in {r['block_kib']} KiB "
        f"blocks, {r['layers']} layers x {r['blocks']} blocks"
    )
    by = r["descriptors_by_order"]
    batches = f" in {r['batches']} engine batches" if r["transport"] == "mooncake" else ""
    print(
        f"descriptors: {r['descriptors']} (sequential {by['sequential']}, shuffled {by['shuffled']}){batches}; "
        f"plan {r['plan_ms']:.2f} ms"
    )
    if r["p_block"] != r["d_block"]:
        print(f"block sizes: P {r['p_block']} tokens, D {r['d_block']}: {r['descriptors']} runs, tokens mapped one by one run")
    if r["p_tp"] != 1 or r["d_tp"] != 1:
        print(
            f"tensor parallelism: {r['kv_heads']} KV heads; P at TP {r['p_tp']} holds heads {r['p_heads']} "
            f"(first, count), D rank {r['d_rank']} of {r['d_tp']} holds {r['d_heads']}: {r['runs_per_block']} runs per block"
        )
    print(
        f"transport: best {r['gbps_best']:.2f} GB/s, median {r['gbps']:.2f} GB/s over {r['repeat']} repeats "
        + ("(bytes verified)" if r["verified"] else "(bytes NOT verified: --copies skip moved none between KV and pool)")
    )
    if "ratio_homogeneous" in r:
        h = r["homogeneous"]
        print(
            f"the same bytes between ranks of one TP size, same run: {h['gbps']:.2f} GB/s, {h['descriptors']} descriptors; "
            f"ratio heterogeneous/homogeneous {r['ratio_homogeneous']:.3f}"
        )
    print(f"memcpy, {r['memcpy']}: best {r['memcpy_gbps_best']:.2f}, median {r['memcpy_gbps']:.2f} GB/s")
    print(f"ratio transport/memcpy (medians): {r['ratio']:.3f}")
    if "tcp_gbps" in r:
        where = "loopback" if r.get("path", "loopback") == "loopback" else "P's namespace to D's"
        print(f"raw TCP, {where} (two processes, sendall/recv_into): median {r['tcp_gbps']:.2f} GB/s; ratio {r['ratio_tcp']:.3f}")
    if "cma_gbps" in r:
        print(
            f"kernel cross-process copy of the same runs (process_vm_{'writev' if r['mode'] == 'push' else 'readv'}, "
            f"{kernel.IOV_MAX} runs a call): 1 thread {r['cma_gbps']:.2f} GB/s ({r['cma_gbps'] / r['memcpy_gbps']:.3f} of memcpy), "
            f"{r['cma_threads']} threads {r['cma_gbps_threads']:.2f} GB/s ({r['cma_gbps_threads'] / r['memcpy_gbps']:.3f}); "
            f"transport/kernel {r['gbps'] / r['cma_gbps']:.3f} and {r['gbps'] / r['cma_gbps_threads']:.3f}"
        )
    if r["staging"]:
        print(
            f"staging ({r.get('staging_mode', 'on')}): {r['pool_mib']} MiB host pool in {r['chunk_kib']} KiB chunks, "
            f"peak {r['pool_peak_slots']} slots in use (D); D's transfers staged {r['posts']['staged']}, "
            f"direct {r['posts']['direct']} (timed, warm-up and latency probes)"
        )
    print(
        f"1-block {r['op'].lower()} latency (all layers, {r['layers']} descriptors): "
        f"median {r['latency_us_1block']} us "
        + (f"(progress delay {r['progress_delay_us']} us, " if r["transport"] == "nixl" else f"(max batch {r['max_batch']}, ")
        + f"poll {r['poll_us']} us)"
    )
    expected = r["repeat"] + 1
    if r["notifs_at_p"] != expected:
        print(f"WARNING: the other process received {r['notifs_at_p']} of {expected} transfer notifications")


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    values = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise SystemExit(f"{flag}: {text!r}; choose from {', '.join(allowed)} (comma-separated with --sweep)")
    return values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--transport", default="nixl", help="nixl or mooncake (--sweep: a comma-separated list)")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--order", default="shuffled", help="sequential or shuffled (--sweep: a list)")
    ap.add_argument(
        "--mode",
        default="pull",
        help="pull: this process READs the other's blocks; push: it WRITEs its blocks into the other's (--sweep: a list)",
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--latency-samples", type=int, default=50)
    add_engine_args(ap, poll_us=50.0)
    ap.add_argument(
        "--staging",
        default="off",
        help="on: move blocks through a host pool; fragmented: only plans of many short runs (--fragment-runs, "
        "--fragment-kib), the rest directly; off (--sweep: a list)",
    )
    ap.add_argument(
        "--fragment-runs", type=int, default=ConnectorConfig.staging_fragment_runs, help="fragmented: fewest runs staged"
    )
    ap.add_argument(
        "--fragment-kib", type=int, default=ConnectorConfig.staging_fragment_kib, help="fragmented: staged below this mean run, KiB"
    )
    # 0: the connector's defaults for the mode (staging_pool_kib, staging_chunk_kib), so that a figure is what users get.
    ap.add_argument("--pool-mib", type=int, default=0, help="staging only: host pool size (default: the connector's for the mode)")
    ap.add_argument("--chunk-kib", type=int, default=0, help="staging only: chunk (pool slot) size (default: the connector's)")
    ap.add_argument(
        "--copies",
        choices=("real", "skip"),
        default="real",
        help="staging only: skip = copy nothing between the KV cache and the pool (bytes not verified): the "
        "pipeline timed as if gather and scatter took no CPU, as a GPU's copy engine approaches",
    )
    ap.add_argument(
        "--huge-pages",
        choices=("on", "off"),
        default="on",
        help="host KV on transparent huge pages, as the connector registers it (host_huge_pages); off: "
        "PyTorch's 4 KiB pages, as vLLM allocates a CPU KV cache",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cma-baseline",
        action="store_true",
        help="also time the kernel's cross-process copy (process_vm_readv/writev) of the same runs with P: "
        "one thread, and one per core",
    )
    ap.add_argument("--tcp-baseline", action="store_true", help="also time the same bytes over a plain TCP socket (ratio_tcp)")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="transfer time against KV size (--sizes-mib) for every transport, mode, order and staging given",
    )
    ap.add_argument(
        "--sizes-mib",
        default=",".join(str(4**i) for i in range(6)),
        help="--sweep: KV sizes in MiB (default 1,4,16,64,256,1024); sizes that do not fit memory are skipped",
    )
    ap.add_argument("--plot", metavar="FILE.png", help="--sweep: draw transfer time against KV size")
    ap.add_argument("--kv-heads", type=int, default=2, help="the model's KV heads (the benchmark KV holds them per rank)")
    ap.add_argument("--p-tp", type=int, default=1, help="P's tensor-parallel size")
    ap.add_argument("--d-tp", type=int, default=1, help="D's tensor-parallel size")
    ap.add_argument("--p-block", type=int, default=0, help="P's tokens per block (default: from --block-kib)")
    ap.add_argument("--d-block", type=int, default=0, help="D's tokens per block (default: P's); another size maps tokens")
    ap.add_argument("--d-rank", type=int, default=0, help="the D rank played here (reads from the first P rank holding its heads)")
    ap.add_argument(
        "--compare-homogeneous",
        action="store_true",
        help="with --p-tp != --d-tp: first the same bytes between ranks of one TP size holding the same heads (ratio_homogeneous)",
    )
    ap.add_argument(
        "--two-hosts",
        action="store_true",
        help="P and D in network namespaces of their own joined by veth pairs and a bridge (root; the "
        "TCP path between hosts): UCX on eth0, Mooncake and the raw TCP baseline on the namespaces' addresses",
    )
    ap.add_argument(
        "--baseline",
        metavar="DIR_OR_COMMIT",
        help="also time another checkout (a directory, or a commit of this repository checked out for the run), "
        "round after round with this one, and report the ratio of their medians (benchmarks/transport/baseline.py)",
    )
    ap.add_argument("--rounds", type=int, default=4, help="--baseline: runs of each checkout, alternating")
    ap.add_argument(
        "--cpus",
        metavar="COUNTS",
        help="run once per count (e.g. 1,2), every process of the run confined to the first that many CPUs, and "
        "report how the speed scales with them (benchmarks/transport/cpus.py)",
    )
    ap.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.cpus and (args.baseline or args.sweep or args.compare_homogeneous):
        ap.error("--cpus times one configuration: not with --sweep, --baseline or --compare-homogeneous")
    if args.baseline:
        from benchmarks.transport.baseline import compare

        if args.rounds < 1:
            ap.error("--rounds must be >= 1")
        result = compare(args)
        print(
            f"this checkout {result['gbps']:.2f} GB/s ({result['ratio_memcpy']:.3f} of memcpy), {args.baseline} "
            f"{result['baseline_gbps']:.2f} GB/s ({result['baseline_ratio_memcpy']:.3f}): ratio {result['ratio_to_baseline']:.3f}"
        )
        if args.json:
            print(json.dumps(result), flush=True)
        return
    with placement(args):
        _main(ap, args)


@contextlib.contextmanager
def placement(args: argparse.Namespace) -> Iterator[None]:
    """--two-hosts: this process (D) inside D's namespace and args.hosts set while inside (P's
    process enters P's namespace itself); the namespaces are removed after. Otherwise loopback."""
    args.hosts = None
    if not args.two_hosts:
        yield
        return
    why = netns.available()
    if why is not None:
        raise SystemExit(f"--two-hosts: {why}")
    old = os.environ.get("UCX_NET_DEVICES")
    with netns.two_hosts() as hosts, netns.inside(hosts.d.netns):
        os.environ["UCX_NET_DEVICES"] = "eth0"  # the namespaces' veth end (inherited by P's process)
        args.hosts = hosts
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("UCX_NET_DEVICES", None)
            else:
                os.environ["UCX_NET_DEVICES"] = old


def _main(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    axes = {
        "transport": _choices(args.transport, ("nixl", "mooncake"), "--transport"),
        "mode": _choices(args.mode, ("pull", "push"), "--mode"),
        "order": _choices(args.order, ("sequential", "shuffled"), "--order"),
        "staging": _choices(args.staging, ("off", "on", "fragmented"), "--staging"),
    }
    logging.basicConfig(level=logging.WARNING)
    if args.sweep:
        from benchmarks.transport.sweep import run_sweep

        run_sweep(args, axes, run)
        return
    if any(len(v) > 1 for v in axes.values()) or args.plot:
        ap.error("lists of transports/modes/orders/staging and --plot need --sweep")
    for key, values in axes.items():
        setattr(args, key, values[0])
    if args.cpus:
        from benchmarks.transport import cpus

        results = cpus.run_counts(args, run)
        for r in results:
            print(f"-- confined to {cpus.label(r['cpus'])}")
            report(r)
        print()
        cpus.report(results)
        if args.json:
            print(json.dumps({"runs": results, **cpus.scaling(results)}), flush=True)
        return
    baseline = None
    if args.compare_homogeneous and (args.p_tp != args.d_tp or args.p_block != args.d_block):
        baseline = run(homogeneous_counterpart(args))
        report(baseline)
        print()
    result = run(args)
    if baseline is not None:
        result["homogeneous"] = {k: baseline[k] for k in ("gbps", "descriptors", "runs_per_block", "xfer_ms")}
        result["ratio_homogeneous"] = round(result["gbps"] / baseline["gbps"], 3)
    report(result)
    if args.json:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
