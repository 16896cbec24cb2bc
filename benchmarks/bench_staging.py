"""Staging against direct, in one run: the same KV blocks moved between two processes with the KV cache
registered (direct) and through a bounded host pool (staged), on CPU or CUDA KV memory.

    python -m benchmarks.bench_staging --device cpu|cuda --transport nixl|mooncake --size-mib 256 \
        --pool-fraction 8 --chunk-kib 1024,4096 --order sequential --json

D (this process) pulls (or, --mode push, writes) every block of P's KV cache; each variant runs in a
fresh P process and the bytes are verified after the first timed transfer. The pool is 1/N of the KV
cache (--pool-fraction). Figures are medians over --repeat transfers; ratios are against the direct
transfer and a same-device copy of the same bytes measured in this run.
"""

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

from benchmarks.bench_transport import HEAD_DIM_X2, KV_HEADS, Shape, add_engine_args, block_ids, make_transport
from kv_connectors.layout import KVLayout, TensorInfo, build_layout
from kv_connectors.plan import TransferPlan, plan_transfer
from kv_connectors.transports.base import MemoryKind, Transport, XferState

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0
XFER_TIMEOUT_S = 120.0
SENTINEL = -0x2152411021524111  # 0xDEADBEEFDEADBEEF as int64


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # "direct" or "staged-<chunk KiB>"
    staged: bool
    chunk_kib: int = 0


def kv_tensors(shape: Shape, device: str) -> list[Any]:
    import torch

    return [
        torch.empty((shape.num_blocks, KV_HEADS, shape.block_size, HEAD_DIM_X2), dtype=torch.float32, device=device)
        for _ in range(shape.layers)
    ]


def words(t: Any) -> Any:
    import torch

    return t.view(t.shape[0], -1).view(torch.int64)


def fill_pattern(kv: list[Any]) -> None:
    """Word w of block b of layer l holds (l << 40) | (b * words_per_block + w)."""
    import torch

    for layer, t in enumerate(kv):
        w = words(t)
        w.copy_(torch.arange(w.numel(), dtype=torch.int64, device=t.device).view(w.shape) | (layer << 40))


def check(kv: list[Any], src_ids: np.ndarray, dst_ids: np.ndarray) -> str | None:
    """None if destination block dst_ids[i] of every layer holds source block src_ids[i]; else what is wrong."""
    import torch

    for layer, t in enumerate(kv):
        w = words(t)
        wpb = w.shape[1]
        src = torch.as_tensor(src_ids, dtype=torch.int64, device=t.device)
        want = (src[:, None] * wpb + torch.arange(wpb, device=t.device)) | (layer << 40)
        if not torch.equal(w[torch.as_tensor(dst_ids, device=t.device)], want):
            return f"VERIFY FAILED: layer {layer} holds wrong bytes after the transfer"
    return None


def layout_of(kv: list[Any], shape: Shape) -> KVLayout:
    infos = [TensorInfo(f"layer{i}", t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size()) for i, t in enumerate(kv)]
    return build_layout(infos, shape.num_blocks, shape.block_size, block_dim=0)


def open_transport(name: str, variant: Variant, pool_bytes: int, args: argparse.Namespace) -> Transport:
    inner = make_transport(args.transport, name, args)
    if not variant.staged:
        return inner
    from kv_connectors.transports.staging import StagedTransport

    return StagedTransport(inner, pool_bytes=pool_bytes, chunk_bytes=variant.chunk_kib << 10)


def memory_kind(device: str) -> MemoryKind:
    return MemoryKind.DEVICE if device == "cuda" else MemoryKind.HOST


def serve_p(conn: Connection, shape: Shape, variant: Variant, pool_bytes: int, args: argparse.Namespace) -> None:
    """P: holds the patterned (pull) or sentinel (push) KV cache; progresses its transport until "stop"."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    kv = kv_tensors(shape, args.device)
    if args.mode == "pull":
        fill_pattern(kv)
    else:
        for t in kv:
            words(t).fill_(SENTINEL)
    transport = open_transport("bench-p", variant, pool_bytes, args)
    idle_s = args.poll_us / 1e6 if variant.staged else 0.01  # a staging P takes part in every chunk
    try:
        layout = layout_of(kv, shape)
        transport.register(layout, memory_kind(args.device), 0)
        conn.send((transport.local_metadata(), layout))
        while True:
            transport.get_notifs()
            if not conn.poll(idle_s):
                continue
            cmd = conn.recv()
            if cmd[0] == "connect":
                transport.connect(cmd[1], cmd[2])
                conn.send("ok")
            elif cmd[0] == "verify":
                conn.send(check(kv, cmd[1], cmd[2]) or "ok")
            elif cmd[0] == "stop":
                conn.send("stopped")
                return
    except (EOFError, BrokenPipeError):
        return
    finally:
        transport.close()


def run_xfer(t: Transport, plan: TransferPlan, push: bool, poll_s: float) -> float:
    start = time.perf_counter()
    handle = t.post_write("bench-p", plan, b"") if push else t.post_read("bench-p", plan, b"")
    try:
        while t.poll(handle) is XferState.IN_PROGRESS:
            if time.perf_counter() - start > XFER_TIMEOUT_S:
                raise RuntimeError(f"transfer did not finish within {XFER_TIMEOUT_S} s")
            if poll_s:
                time.sleep(poll_s)
        return time.perf_counter() - start
    finally:
        t.release(handle)


def ask(conn: Connection, msg: tuple[Any, ...], what: str) -> Any:
    conn.send(msg)
    if not conn.poll(START_TIMEOUT_S):
        raise RuntimeError(f"P did not answer {what} within {START_TIMEOUT_S} s")
    return conn.recv()


def run_variant(variant: Variant, shape: Shape, pool_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """One variant in a fresh P: warm-up, verified first timed transfer, then the rest."""
    import torch

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve_p, args=(child, shape, variant, pool_bytes, args), daemon=True)
    proc.start()
    child.close()
    transport = None
    push = args.mode == "push"
    try:
        kv = kv_tensors(shape, args.device)
        if push:
            fill_pattern(kv)
        transport = open_transport("bench-d", variant, pool_bytes, args)
        local = layout_of(kv, shape)
        transport.register(local, memory_kind(args.device), 0)
        if not parent.poll(START_TIMEOUT_S):
            raise RuntimeError(f"P did not start within {START_TIMEOUT_S} s")
        p_md, remote = parent.recv()
        transport.connect("bench-p", p_md)
        if variant.staged and ask(parent, ("connect", "bench-d", transport.local_metadata()), "connect") != "ok":
            raise RuntimeError("P did not connect back to D")
        src_ids, dst_ids = block_ids(args.order, shape.num_blocks, args.seed)
        src_layout, dst_layout = (local, remote) if push else (remote, local)
        plan = plan_transfer(src_layout, src_ids, dst_layout, dst_ids)
        poll_s = args.poll_us / 1e6
        run_xfer(transport, plan, push, poll_s)  # connection set-up, registration caches
        if not push:
            for t in kv:
                words(t).fill_(SENTINEL)
            if args.device == "cuda":
                torch.cuda.synchronize()
        secs = [run_xfer(transport, plan, push, poll_s)]
        err = ask(parent, ("verify", src_ids, dst_ids), "verify") if push else check(kv, src_ids, dst_ids)
        if err not in (None, "ok"):
            raise RuntimeError(err)
        secs += [run_xfer(transport, plan, push, poll_s) for _ in range(args.repeat - 1)]
        gbps = [plan.total_bytes / s / 1e9 for s in secs]
        out = {
            "variant": variant.name,
            "staged": variant.staged,
            "descriptors": plan.num_runs,
            "bytes": plan.total_bytes,
            "gbps": round(statistics.median(gbps), 3),
            "gbps_best": round(max(gbps), 3),
            "xfer_ms": round(statistics.median(secs) * 1e3, 3),
            "verified": True,
        }
        if variant.staged:
            stats = transport.pool_stats()  # type: ignore[attr-defined]
            out.update(
                chunk_kib=variant.chunk_kib,
                pool_bytes=stats["allocated_bytes"],
                peak_slots=stats["peak_slots_in_use"],
                slots=stats["slots"],
            )
        ask(parent, ("stop",), "stop")
        return out
    finally:
        if transport is not None:
            transport.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def copy_gbps(nbytes: int, device: str, repeat: int) -> float:
    """A same-device copy of nbytes as one contiguous tensor copy (host: memcpy; CUDA: device to device)."""
    import torch

    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    out = []
    for _ in range(repeat + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(out[1:])


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = Shape(args.size_mib, args.block_kib, args.layers)
    shape.check()
    kv_bytes = shape.size_mib << 20
    chunks = [int(c) for c in args.chunk_kib.split(",") if c.strip()]
    variants = [Variant("direct", False)] + [Variant(f"staged-{c}k", True, c) for c in chunks]
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    results: dict[str, Any] = {}
    for v in variants:
        pool = (kv_bytes // args.pool_fraction) // ((v.chunk_kib or 1) << 10) * ((v.chunk_kib or 1) << 10)
        try:
            results[v.name] = run_variant(v, shape, pool, args)
        except Exception as e:  # one variant failing (e.g. VRAM registration refused) still reports the rest
            logger.exception("variant %s failed", v.name)
            results[v.name] = {"variant": v.name, "error": f"{type(e).__name__}: {e}"}
    copy = copy_gbps(kv_bytes, args.device, args.repeat)
    direct = results["direct"].get("gbps")
    for r in results.values():
        if "gbps" in r:
            r["ratio_to_copy"] = round(r["gbps"] / copy, 3)
            if direct:
                r["ratio_to_direct"] = round(r["gbps"] / direct, 3)
            if r.get("pool_bytes"):
                r["pool_fraction_of_kv"] = round(r["pool_bytes"] / kv_bytes, 4)
    return {
        "device": args.device,
        "transport": args.transport,
        "mode": args.mode,
        "order": args.order,
        "size_mib": args.size_mib,
        "block_kib": args.block_kib,
        "layers": args.layers,
        "kv_bytes": kv_bytes,
        "copy_gbps": round(copy, 3),
        "copy": "one contiguous same-device tensor copy (host memcpy or CUDA device-to-device)",
        "variants": results,
    }


def report(r: dict[str, Any]) -> None:
    print(
        f"{r['transport']} {r['mode']} on {r['device']} KV, {r['order']}: {r['size_mib']} MiB in "
        f"{r['block_kib']} KiB blocks, {r['layers']} layers; same-device copy {r['copy_gbps']:.2f} GB/s"
    )
    print(f"{'variant':<16} {'GB/s':>8} {'of direct':>10} {'of copy':>8} {'pool/KV':>8} {'peak slots':>11}")
    for v in r["variants"].values():
        if "error" in v:
            print(f"{v['variant']:<16} FAILED: {v['error']}")
            continue
        frac = f"{v['pool_fraction_of_kv']:.3f}" if v.get("pool_fraction_of_kv") else "-"
        peak = f"{v['peak_slots']}/{v['slots']}" if v.get("slots") else "-"
        print(
            f"{v['variant']:<16} {v['gbps']:>8.2f} {v.get('ratio_to_direct', float('nan')):>10.3f} "
            f"{v['ratio_to_copy']:>8.3f} {frac:>8} {peak:>11}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both KV caches live")
    ap.add_argument("--transport", default="nixl", choices=("nixl", "mooncake"))
    ap.add_argument("--mode", default="pull", choices=("pull", "push"))
    ap.add_argument("--order", default="sequential", choices=("sequential", "shuffled"))
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pool-fraction", type=int, default=8, help="staging pool = KV cache / N")
    ap.add_argument("--chunk-kib", default="1024", help="staging chunk sizes to try (comma-separated)")
    ap.add_argument("--repeat", type=int, default=5)
    add_engine_args(ap, poll_us=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    args = ap.parse_args()
    if args.pool_fraction < 1:
        ap.error("--pool-fraction must be >= 1")
    logging.basicConfig(level=logging.WARNING)
    result = run(args)
    report(result)
    if args.json:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
