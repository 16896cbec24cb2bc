"""bench_e2e.py's figures: per-request samples to a per-configuration summary, ratios between configurations, tables."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

# Figures every configuration reports, and that get a ratio to the baselines.
RATIO_FIGURES = (
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_mean_ms",
    "output_tok_s",
    "kv_bytes",
    "gbps",
    "cpu_ms_per_request",
)
# Each ratio key over the first of its configurations the run has: the built-in as shipped, else the
# tuned one (the report names which); colocated.
BASELINES = {"vs_builtin": ("builtin-nixl", "builtin-nixl-patched"), "vs_colocated": ("colocated",)}


def baseline(results: Mapping[str, Any], key: str) -> str | None:
    """The configuration the `key` ratios are over (BASELINES), or None when the run has none of them."""
    return next((name for name in BASELINES[key] if name in results), None)


def builtin_baseline(results: Mapping[str, Any]) -> str | None:
    """The configuration /bi ratios are over: builtin-nixl, else builtin-nixl-patched, else None."""
    return baseline(results, "vs_builtin")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One streamed request: prompt length, time to the first token and to the end, tokens received.

    first_chunk_tokens: tokens in the first chunk; more than 1 means the server's output stream lagged
    its engine (outputs queued up while the API server was starved of CPU)."""

    length: int
    ttft_s: float
    e2e_s: float
    output_ids: tuple[int, ...]
    first_chunk_tokens: int = 1


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def summarize(samples: Sequence[Sample], wall_s: float) -> dict[str, Any]:
    """TTFT mean/p50/p99, end-to-end mean/p50 (ms), output tokens/s over the run's wall time, per-length means."""
    if not samples:
        raise ValueError("no samples to summarize")
    if wall_s <= 0:
        raise ValueError(f"wall time must be positive, got {wall_s}")
    ttft = [s.ttft_s for s in samples]
    e2e = [s.e2e_s for s in samples]
    lengths = sorted({s.length for s in samples})
    return {
        "requests": len(samples),
        "ttft_mean_ms": _ms(statistics.fmean(ttft)),
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "e2e_mean_ms": _ms(statistics.fmean(e2e)),
        "e2e_p50_ms": _ms(percentile(e2e, 50)),
        "output_tokens": sum(len(s.output_ids) for s in samples),
        "output_tok_s": round(sum(len(s.output_ids) for s in samples) / wall_s, 2),
        "wall_s": round(wall_s, 3),
        "first_chunk_tokens_mean": round(statistics.fmean(s.first_chunk_tokens for s in samples), 2),
        "ttft_by_length_ms": {str(n): _ms(statistics.fmean(s.ttft_s for s in samples if s.length == n)) for n in lengths},
        "e2e_by_length_ms": {str(n): _ms(statistics.fmean(s.e2e_s for s in samples if s.length == n)) for n in lengths},
    }


def kv_figures(kv_bytes: int | None, kv_seconds: float | None) -> dict[str, Any]:
    """KV bytes moved and effective GB/s (bytes over summed transfer seconds); None where unknown."""
    gbps = kv_bytes / kv_seconds / 1e9 if kv_bytes is not None and kv_seconds else None
    return {
        "kv_bytes": kv_bytes,
        "kv_seconds": None if kv_seconds is None else round(kv_seconds, 6),
        "gbps": None if gbps is None else float(f"{gbps:.4g}"),  # significant digits: a slow load is not 0
    }


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base rounded to 3 decimals; None when either is unknown or the base is 0."""
    if value is None or base is None or base == 0:
        return None
    return round(value / base, 3)


def add_ratios(results: Mapping[str, dict[str, Any]]) -> None:
    """Give every configuration `vs_builtin` and `vs_colocated`: each RATIO_FIGURES figure over the baseline's.

    The built-in baseline is builtin-nixl, else builtin-nixl-patched (BASELINES). A baseline that
    is absent or failed gives None ratios (a failed configuration's figures are None).
    """
    for key in BASELINES:
        name = baseline(results, key)
        base = results[name] if name is not None else None
        for entry in results.values():
            entry[key] = {f: ratio(entry.get(f), base.get(f) if base else None) for f in RATIO_FIGURES}


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def figures_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per configuration: the figures people compare."""
    head = (
        f"{'config':<22} {'ok':>4} {'reqs':>4} {'TTFT mean':>9} {'p50':>8} {'p99':>8} {'e2e mean':>9} "
        f"{'out tok/s':>9} {'KV MiB':>8} {'KV GB/s':>7} {'CPU ms/req':>10}"
    )
    rows = [head, "-" * len(head)]
    for name, r in results.items():
        kv_mib = None if r.get("kv_bytes") is None else r["kv_bytes"] / 2**20
        rows.append(
            f"{name:<22} {'yes' if r.get('ok') else 'NO':>4} {r.get('requests', 0):>4} "
            f"{_fmt(r.get('ttft_mean_ms'), '9.1f')} {_fmt(r.get('ttft_p50_ms'), '8.1f')} "
            f"{_fmt(r.get('ttft_p99_ms'), '8.1f')} {_fmt(r.get('e2e_mean_ms'), '9.1f')} "
            f"{_fmt(r.get('output_tok_s'), '9.1f')} {_fmt(kv_mib, '8.2f')} {_fmt(r.get('gbps'), '7.2f')} "
            f"{_fmt(r.get('cpu_ms_per_request'), '10.1f')}"
        )
    return "\n".join(rows)


def ratios_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per configuration: TTFT, e2e, tok/s, CPU per request and GB/s over the built-in connector's and colocated's."""
    cols = (
        ("ttft_mean_ms", "TTFT"),
        ("ttft_p99_ms", "p99"),
        ("e2e_mean_ms", "e2e"),
        ("output_tok_s", "tok/s"),
        ("cpu_ms_per_request", "CPU"),
        ("gbps", "GB/s"),
    )
    head = (
        f"{'config':<22} "
        + " ".join(f"{label + '/bi':>9}" for _, label in cols)
        + "  "
        + " ".join(f"{label + '/co':>9}" for _, label in cols[:5])
    )
    rows = [head, "-" * len(head)]
    for name, r in results.items():
        vb, vc = r.get("vs_builtin", {}), r.get("vs_colocated", {})
        rows.append(
            f"{name:<22} "
            + " ".join(_fmt(vb.get(f), "9.2f") for f, _ in cols)
            + "  "
            + " ".join(_fmt(vc.get(f), "9.2f") for f, _ in cols[:5])
        )
    return "\n".join(rows)


def by_length_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Mean TTFT (ms) per prompt length, one column per configuration (what --plot draws)."""
    names = [n for n, r in results.items() if r.get("ttft_by_length_ms")]
    lengths = sorted({int(k) for n in names for k in results[n]["ttft_by_length_ms"]})
    head = f"{'tokens':>6} " + " ".join(f"{n[:20]:>20}" for n in names)
    rows = [head, "-" * len(head)]
    for length in lengths:
        rows.append(f"{length:>6} " + " ".join(_fmt(results[n]["ttft_by_length_ms"].get(str(length)), "20.1f") for n in names))
    return "\n".join(rows)
