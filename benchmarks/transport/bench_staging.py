"""Staging against direct, in one run: the same KV blocks moved between two processes with the KV cache
registered (direct) and through a bounded host pool (staged), on CPU or CUDA KV memory.

    python -m benchmarks.transport.bench_staging --device cpu|cuda --transport nixl|mooncake --size-mib 256 \
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
import os
import statistics
import time
from typing import Any

from benchmarks.transport.harness import add_engine_args, block_ids, engine_spec, open_side, start_p
from kv_connectors.plan import TransferPlan, plan_transfer
from kv_connectors.transports.base import Transport, XferState
from kvc_testing import peers
from kvc_testing.kvbuffers import Shape, check_pattern, fill_sentinel
from kvc_testing.peers import Peer

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0
XFER_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # "direct" or "staged-<chunk KiB>"
    staged: bool
    chunk_kib: int = 0


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


def run_variant(variant: Variant, shape: Shape, pool_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """One variant in a fresh P: warm-up, verified first timed transfer, then the rest."""
    import torch

    push = args.mode == "push"
    pool, chunk = (pool_bytes, variant.chunk_kib << 10) if variant.staged else (0, 0)
    transport = None
    p: Peer | None = None
    try:
        # P holds the patterned (pull) or sentinel (push) KV cache; D the other.
        p_spec = engine_spec(args, "bench-p", shape, "sentinel" if push else "pattern", pool, chunk)
        transport, kv, local = open_side(engine_spec(args, "bench-d", shape, "pattern" if push else "", pool, chunk))
        try:
            p = start_p(p_spec, START_TIMEOUT_S)
        except SystemExit as e:
            raise RuntimeError(str(e)) from e
        transport.connect("bench-p", p.metadata)
        if variant.staged and p.call("connect", "bench-d", transport.local_metadata()) != "ok":
            raise RuntimeError("P did not connect back to D")
        remote = p.layout
        assert remote is not None
        src_ids, dst_ids = block_ids(args.order, shape.num_blocks, args.seed)
        src_layout, dst_layout = (local, remote) if push else (remote, local)
        plan = plan_transfer(src_layout, src_ids, dst_layout, dst_ids)
        poll_s = args.poll_us / 1e6
        run_xfer(transport, plan, push, poll_s)  # connection set-up, registration caches
        if not push:
            fill_sentinel(kv)
            if args.device == "cuda":
                torch.cuda.synchronize()
        secs = [run_xfer(transport, plan, push, poll_s)]
        err = p.call("verify", src_ids, dst_ids) if push else check_pattern(kv, src_ids, dst_ids)
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
        return out
    finally:
        if p is not None:
            peers.stop_peers([p])
        if transport is not None:
            transport.close()


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
