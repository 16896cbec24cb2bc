"""bench_transport.py --sweep: KV transfer time against KV size for every transport, mode, order and staging asked."""

from __future__ import annotations

import argparse
import copy
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Peak memory of one point: P's KV cache, D's, and the memcpy baseline's source and destination.
BUFFERS_PER_POINT = 4
HEADROOM_BYTES = 2 << 30  # left for the other processes on a shared host
AXES = ("transport", "mode", "order", "staging")


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    for line in Path(meminfo).read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no MemAvailable in {meminfo}")


def fits(size_mib: int, available: int) -> str | None:
    """None if a point of size_mib fits in `available` bytes, else why not."""
    need = BUFFERS_PER_POINT * (size_mib << 20) + HEADROOM_BYTES
    if need > available:
        return f"needs ~{need / 2**30:.1f} GiB ({BUFFERS_PER_POINT} x size + headroom), {available / 2**30:.1f} available"
    return None


def parse_sizes(text: str) -> list[int]:
    sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"--sizes-mib needs sizes >= 1 MiB, got {text!r}")
    return sizes


def series_name(r: Mapping[str, Any]) -> str:
    staging = r.get("staging_mode", "on" if r["staging"] else "off")  # results of older checkouts say True/False
    return f"{r['transport']} {r['mode']} {r['order']}" + {"off": "", "on": " staging"}.get(staging, f" staging {staging}")


def fit(points: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """Least-squares time = fixed + bytes / bandwidth over a series' points (None under two sizes).

    The largest sizes dominate it: marginal_gbps is the bandwidth of big transfers; fixed_ms is
    only indicative (it can come out negative on a noisy host; the smallest point's time is the
    better fixed-cost figure)."""
    if len({p["bytes"] for p in points}) < 2:
        return None
    slope, intercept = np.polyfit([p["bytes"] for p in points], [p["xfer_ms"] / 1e3 for p in points], 1)
    return {
        "fixed_ms": round(float(intercept) * 1e3, 3),
        "marginal_gbps": round(1 / float(slope) / 1e9, 3) if slope > 0 else float("inf"),
    }


def summary(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per series: the fit, and how much the time grew from the smallest to the largest size."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(series_name(r) for r in results):
        pts = sorted((r for r in results if series_name(r) == name), key=lambda r: r["bytes"])
        first, last = pts[0], pts[-1]
        out[name] = {
            "fit": fit(pts),
            "sizes_mib": [p["size_mib"] for p in pts],
            "smallest_ms": first["xfer_ms"],
            "largest_ms": last["xfer_ms"],
            "time_growth": round(last["xfer_ms"] / first["xfer_ms"], 1) if first["xfer_ms"] else None,
            "size_growth": last["bytes"] / first["bytes"],
        }
    return out


def table(results: Sequence[Mapping[str, Any]]) -> str:
    head = f"{'series':<30} {'MiB':>6} {'descs':>7} {'xfer ms':>10} {'GB/s':>7} {'memcpy ms':>10} {'ratio':>6}"
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{series_name(r):<30} {r['size_mib']:>6} {r['descriptors']:>7} {r['xfer_ms']:>10.3f} "
            f"{r['gbps']:>7.2f} {r['memcpy_ms']:>10.3f} {r['ratio']:>6.3f}"
        )
    return "\n".join(rows)


def plot(results: Sequence[Mapping[str, Any]], path: str) -> None:
    from benchmarks.plots import line_plot

    series: dict[str, tuple[list[float], list[float]]] = {}
    for name in dict.fromkeys(series_name(r) for r in results):
        pts = sorted((r for r in results if series_name(r) == name), key=lambda r: r["size_mib"])
        series[name] = ([p["size_mib"] for p in pts], [p["xfer_ms"] for p in pts])
    sizes = sorted({r["size_mib"] for r in results})
    series["memcpy (1 thread)"] = (
        sizes,
        [float(np.median([r["memcpy_ms"] for r in results if r["size_mib"] == s])) for s in sizes],
    )
    first = results[0]
    out = line_plot(
        series,
        path,
        title="KV transfer time against KV size (two processes, one host)",
        xlabel="KV size (MiB)",
        ylabel="transfer time (ms, median)",
        logx=True,
        logy=True,
        note=f"{first['block_kib']} KiB blocks, {first['layers']} layers; bench_transport.py --sweep",
    )
    print(f"plot: {out}")


def run_sweep(
    args: argparse.Namespace, axes: Mapping[str, list[str]], run_one: Callable[[argparse.Namespace], dict[str, Any]]
) -> None:
    """Every combination of the axes at every size that fits memory; prints a table (and JSON, plot)."""
    sizes = parse_sizes(args.sizes_mib)
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for combo in itertools.product(*(axes[a] for a in AXES)):
        point = dict(zip(AXES, combo))
        for size in sizes:
            why = fits(size, mem_available_bytes())
            if why:
                skipped.append({**point, "size_mib": size, "reason": why})
                print(f"skip {point} {size} MiB: {why}", flush=True)
                continue
            a = copy.copy(args)
            for key, value in {**point, "size_mib": size}.items():
                setattr(a, key, value)
            try:
                r = run_one(a)
            except SystemExit as e:  # bench_transport's own errors (bad shape, verification, timeouts)
                failed.append({**point, "size_mib": size, "error": str(e)})
                print(f"FAILED {point} {size} MiB: {e}", flush=True)
                continue
            results.append(r)
            print(f"{series_name(r)} {size} MiB: {r['xfer_ms']:.3f} ms, {r['gbps']:.2f} GB/s", flush=True)
    print()
    print(table(results))
    growth = summary(results)
    for name, g in growth.items():
        f = g["fit"]
        if f:
            lo, hi = g["sizes_mib"][0], g["sizes_mib"][-1]
            print(
                f"{name}: {g['smallest_ms']:.3f} ms at {lo} MiB, {g['largest_ms']:.1f} ms at {hi} MiB "
                f"({g['size_growth']:.0f}x the bytes, {g['time_growth']}x the time); "
                f"marginal {f['marginal_gbps']:.2f} GB/s (least squares)"
            )
    if args.plot and results:
        plot(results, args.plot)
    if args.json:
        print(json.dumps({"sweep": results, "growth": growth, "skipped": skipped, "failed": failed}), flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} sweep point(s) failed")
