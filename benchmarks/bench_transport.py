"""Transport throughput: D pulls N MiB of KV blocks from P (two processes), compared with one-thread memcpy."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kv_connectors.layout import KVLayout, TensorInfo, build_layout
from kv_connectors.plan import TransferPlan, plan_transfer
from kv_connectors.transports.base import Transport, XferState

logger = logging.getLogger(__name__)

KV_HEADS = 2
HEAD_DIM_X2 = 64  # K and V fused in the last dim, as vLLM's CPU layout (num_blocks, heads, block_size, 2*head)
F32 = 4
SENTINEL = np.uint64(0xDEADBEEFDEADBEEF)
START_TIMEOUT_S = 120.0
XFER_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Shape:
    """A KV cache of `layers` tensors (num_blocks, KV_HEADS, block_size, HEAD_DIM_X2) float32."""

    size_mib: int
    block_kib: int
    layers: int

    @property
    def block_size(self) -> int:  # tokens per block giving block_kib KiB per layer segment
        return self.block_kib * 1024 // (KV_HEADS * HEAD_DIM_X2 * F32)

    @property
    def num_blocks(self) -> int:
        return self.size_mib * 1024 // (self.block_kib * self.layers)

    @property
    def words_per_block(self) -> int:  # uint64 words in one block segment
        return self.block_kib * 1024 // 8

    def check(self) -> None:
        if self.block_kib * 1024 % (KV_HEADS * HEAD_DIM_X2 * F32) or self.block_size < 1:
            raise SystemExit(f"--block-kib must be a multiple of {KV_HEADS * HEAD_DIM_X2 * F32 // 1024 or 1} KiB")
        if self.num_blocks < 1 or self.num_blocks * self.block_kib * self.layers != self.size_mib * 1024:
            raise SystemExit("--size-mib must be a multiple of --block-kib x --layers")


def make_kv(shape: Shape) -> list[np.ndarray]:
    return [np.empty((shape.num_blocks, KV_HEADS, shape.block_size, HEAD_DIM_X2), dtype=np.float32) for _ in range(shape.layers)]


def words(t: np.ndarray) -> np.ndarray:
    """A layer tensor as (num_blocks, words_per_block) uint64: pattern and checks ignore floats."""
    return t.reshape(t.shape[0], -1).view(np.uint64)


def fill_pattern(kv: list[np.ndarray], shape: Shape) -> None:
    """Word w of block b of layer l holds (l << 40) | (b * words_per_block + w): every word is unique."""
    for layer, t in enumerate(kv):
        w = words(t)
        w[:] = np.arange(w.size, dtype=np.uint64).reshape(w.shape) | np.uint64(layer << 40)


def verify(kv: list[np.ndarray], shape: Shape, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """Destination block dst_ids[i] of every layer must hold source block src_ids[i] exactly."""
    wpb = shape.words_per_block
    lane = np.arange(wpb, dtype=np.uint64)
    for layer, t in enumerate(kv):
        want = (src_ids.astype(np.uint64)[:, None] * np.uint64(wpb) + lane) | np.uint64(layer << 40)
        if not np.array_equal(words(t)[dst_ids], want):
            raise SystemExit(f"VERIFY FAILED: layer {layer} holds wrong bytes after the transfer")


def layout_of(kv: list[np.ndarray], shape: Shape) -> KVLayout:
    infos = [
        TensorInfo(f"layer{i}", t.ctypes.data, t.shape, tuple(s // t.itemsize for s in t.strides), t.itemsize)
        for i, t in enumerate(kv)
    ]
    return build_layout(infos, shape.num_blocks, shape.block_size, block_dim=0)


def add_engine_args(ap: argparse.ArgumentParser, poll_us: float) -> None:
    """The engine knobs make_transport reads, and the sleep between polls."""
    ap.add_argument("--progress-delay-us", type=int, default=1000, help="NIXL only: progress-thread delay")
    ap.add_argument("--num-threads", type=int, default=None, help="NIXL only")
    ap.add_argument("--max-batch", type=int, default=1000, help="Mooncake only: runs per engine batch")
    ap.add_argument("--mooncake-protocol", default="tcp", help="Mooncake only: engine protocol")
    ap.add_argument("--poll-us", type=float, default=poll_us, help="sleep between polls (0: spin)")


def make_transport(kind: str, name: str, args: argparse.Namespace) -> Transport:
    if kind == "nixl":
        from kv_connectors.transports.nixl import NixlTransport

        return NixlTransport(name, progress_delay_us=args.progress_delay_us, num_threads=args.num_threads)
    if kind == "mooncake":
        from kv_connectors.transports.mooncake import MooncakeTransport

        return MooncakeTransport(name, protocol=args.mooncake_protocol, max_batch=args.max_batch)
    raise SystemExit(f"unknown transport {kind!r}")


def maybe_staged(transport: Transport, args: argparse.Namespace) -> Transport:
    """--staging on: the same engine behind a StagedTransport (KV blocks go through a host pool)."""
    if args.staging != "on":
        return transport
    from kv_connectors.transports.staging import StagedTransport

    return StagedTransport(transport, pool_bytes=args.pool_mib << 20, chunk_bytes=args.chunk_kib << 10)


def serve_p(conn: Connection, shape: Shape, args: argparse.Namespace) -> None:
    """P: owns the source KV cache; answers ("notifs",) with the count received and ("stop",)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    kv = make_kv(shape)
    if args.mode == "pull":
        fill_pattern(kv, shape)  # D reads these blocks
    else:
        for t in kv:
            words(t)[:] = SENTINEL  # the other process writes into these blocks
    transport = maybe_staged(make_transport(args.transport, "bench-p", args), args)
    idle_s = args.poll_us / 1e6 if args.staging == "on" else 0.01  # a staging P takes part in every chunk
    try:
        layout = layout_of(kv, shape)
        transport.register(layout)
        conn.send((transport.local_metadata(), layout))
        received = 0
        while True:
            received += len(transport.get_notifs())
            if conn.poll(idle_s):
                cmd = conn.recv()
                if cmd[0] == "connect":  # staging: P answers D over notifications, so it connects back
                    transport.connect(cmd[1], cmd[2])
                    conn.send("ok")
                    continue
                if cmd[0] == "stop":
                    conn.send(received)
                    return
                if cmd[0] == "verify":  # push: the written blocks must hold the sources exactly
                    try:
                        verify(kv, shape, cmd[1], cmd[2])
                        conn.send("ok")
                    except SystemExit as e:
                        conn.send(str(e))
                    continue
                conn.send(received)
    except (EOFError, BrokenPipeError):
        return
    finally:
        transport.close()


def wait_notifs(conn: Connection, expected: int, timeout: float = 10.0) -> int:
    """Notifications P received (one per full read); stops P. -1 if P does not answer."""
    deadline = time.monotonic() + timeout
    received = -1
    while True:
        last = time.monotonic() >= deadline
        conn.send(("stop",) if last else ("notifs",))
        if not conn.poll(timeout):
            return -1
        received = conn.recv()
        if last:
            return received
        if received >= expected:
            conn.send(("stop",))
            return conn.recv() if conn.poll(timeout) else received
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


def block_ids(order: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if order == "sequential":
        return np.arange(n), np.arange(n)
    # A real block table: P's and D's allocators each hand out their own free blocks, so the
    # remote (source) and local (destination) ids are two independent permutations.
    rng = np.random.default_rng(seed)
    return rng.permutation(n), rng.permutation(n)


def time_plan(src: KVLayout, dst: KVLayout, s: np.ndarray, d: np.ndarray) -> tuple[TransferPlan, float]:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        plan = plan_transfer(src, s, dst, d)
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = Shape(args.size_mib, args.block_kib, args.layers)
    shape.check()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback between the two processes
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve_p, args=(child, shape, args), daemon=True)
    proc.start()
    child.close()
    transport = None
    try:
        kv = make_kv(shape)
        for t in kv:
            words(t)[:] = SENTINEL  # prefault, and mark every byte as "not copied"
        transport = maybe_staged(make_transport(args.transport, "bench-d", args), args)
        local = layout_of(kv, shape)
        transport.register(local)
        if not parent.poll(START_TIMEOUT_S):
            raise SystemExit(f"P did not start within {START_TIMEOUT_S} s")
        p_md, remote = parent.recv()
        transport.connect("bench-p", p_md)
        if args.staging == "on":
            parent.send(("connect", "bench-d", transport.local_metadata()))
            if not parent.poll(START_TIMEOUT_S) or parent.recv() != "ok":
                raise SystemExit("P did not connect back to D (staging)")
        poll_s = args.poll_us / 1e6

        push = args.mode == "push"
        src_layout, dst_layout = (local, remote) if push else (remote, local)
        counts = {}
        for o in ("sequential", "shuffled"):
            s_ids, d_ids = block_ids(o, shape.num_blocks, args.seed)
            counts[o] = plan_transfer(src_layout, s_ids, dst_layout, d_ids).num_runs
        src_ids, dst_ids = block_ids(args.order, shape.num_blocks, args.seed)
        plan, plan_s = time_plan(src_layout, dst_layout, src_ids, dst_ids)

        one = plan_transfer(src_layout, [0], dst_layout, [0])  # one block of every layer: latency probe
        if push:
            fill_pattern(kv, shape)
        run_xfer(transport, plan, poll_s, b"warmup", write=push)  # connection set-up, page tables
        if push:
            parent.send(("verify", src_ids, dst_ids))
            answer = parent.recv() if parent.poll(START_TIMEOUT_S) else "no answer"
            if answer != "ok":
                raise SystemExit(f"push verification at the receiver failed: {answer}")
        else:
            for t in kv:
                words(t)[:] = SENTINEL
        batches: list[int] = []
        secs = [run_xfer(transport, plan, poll_s, b"timed", batches, write=push)]
        if not push:
            verify(kv, shape, src_ids, dst_ids)
        secs += [run_xfer(transport, plan, poll_s, b"timed", write=push) for _ in range(args.repeat - 1)]
        lat = [run_xfer(transport, one, poll_s, b"", write=push) for _ in range(args.latency_samples)]

        notifs = wait_notifs(parent, expected=args.repeat + 1)
        gbps = [plan.total_bytes / s / 1e9 for s in secs]
        mem = memcpy_gbps(plan.total_bytes, args.repeat)
        return {
            "transport": args.transport,
            "op": "WRITE" if push else "READ",
            "mode": args.mode,
            "order": args.order,
            "size_mib": args.size_mib,
            "block_kib": args.block_kib,
            "layers": args.layers,
            "blocks": shape.num_blocks,
            "bytes": plan.total_bytes,
            "descriptors": plan.num_runs,
            "descriptors_by_order": counts,
            "plan_ms": round(plan_s * 1e3, 3),
            "repeat": args.repeat,
            "gbps": round(statistics.median(gbps), 3),
            "gbps_best": round(max(gbps), 3),
            "memcpy_gbps": round(statistics.median(mem), 3),
            "memcpy_gbps_best": round(max(mem), 3),
            "memcpy": "numpy.copyto of one contiguous buffer (single-thread memcpy)",
            "ratio": round(statistics.median(gbps) / statistics.median(mem), 3),
            "xfer_ms": round(statistics.median(secs) * 1e3, 3),
            "memcpy_ms": round(plan.total_bytes / statistics.median(mem) / 1e6, 3),
            "latency_us_1block": round(statistics.median(lat) * 1e6, 1) if lat else None,
            "progress_delay_us": args.progress_delay_us if args.transport == "nixl" else None,
            "num_threads": args.num_threads if args.transport == "nixl" else None,
            "batches": batches[0],
            "max_batch": args.max_batch if args.transport == "mooncake" else None,
            "poll_us": args.poll_us,
            "notifs_at_p": notifs,
            "staging": args.staging == "on",
            "pool_mib": args.pool_mib if args.staging == "on" else None,
            "chunk_kib": args.chunk_kib if args.staging == "on" else None,
            "pool_peak_slots": transport.pool_stats()["peak_slots_in_use"] if args.staging == "on" else None,
            "verified": True,
        }
    finally:
        if transport is not None:
            transport.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


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
    print(f"transport: best {r['gbps_best']:.2f} GB/s, median {r['gbps']:.2f} GB/s over {r['repeat']} repeats (bytes verified)")
    print(f"memcpy, {r['memcpy']}: best {r['memcpy_gbps_best']:.2f}, median {r['memcpy_gbps']:.2f} GB/s")
    print(f"ratio transport/memcpy (medians): {r['ratio']:.3f}")
    if r["staging"]:
        print(
            f"staging: {r['pool_mib']} MiB host pool in {r['chunk_kib']} KiB chunks, peak {r['pool_peak_slots']} slots in use (D)"
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
    ap.add_argument("--staging", default="off", help="on: move blocks through a host pool; off (--sweep: a list)")
    ap.add_argument("--pool-mib", type=int, default=32, help="staging only: host pool size")
    ap.add_argument("--chunk-kib", type=int, default=1024, help="staging only: chunk (pool slot) size")
    ap.add_argument("--seed", type=int, default=0)
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
    ap.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    axes = {
        "transport": _choices(args.transport, ("nixl", "mooncake"), "--transport"),
        "mode": _choices(args.mode, ("pull", "push"), "--mode"),
        "order": _choices(args.order, ("sequential", "shuffled"), "--order"),
        "staging": _choices(args.staging, ("off", "on"), "--staging"),
    }
    logging.basicConfig(level=logging.WARNING)
    if args.sweep:
        from benchmarks.transport_sweep import run_sweep

        run_sweep(args, axes, run)
        return
    if any(len(v) > 1 for v in axes.values()) or args.plot:
        ap.error("lists of transports/modes/orders/staging and --plot need --sweep")
    for key, values in axes.items():
        setattr(args, key, values[0])
    result = run(args)
    report(result)
    if args.json:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
