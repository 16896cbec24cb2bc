"""`python -m benchmarks.e2e.bench_e2e` end to end on the tiny model: ours and vLLM's built-in connector against colocated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PD = ("ours-nixl-pull", "builtin-nixl")
REQUIRED = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "e2e_mean_ms", "kv_bytes", "gbps", "cpu_ms_per_request")
LENGTHS = (64, 160)
MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(600)


# One after another runs ours alone (each configuration takes the same path there); interleaved runs
# ours beside the built-in, so the built-in's figures and the ratio between them are checked there.
@pytest.mark.parametrize("interleave, pd", [(False, PD[:1]), (True, PD)], ids=["one-after-another", "interleaved"])
def test_bench_e2e_reports_every_config_with_matching_outputs(interleave: bool, pd: tuple[str, ...]):
    argv = [
        sys.executable,
        "-m",
        "benchmarks.e2e.bench_e2e",
        "--configs",
        ",".join(pd),
        "--lengths",
        ",".join(map(str, LENGTHS)),
        "--repeats",
        "1",
        "--max-tokens",
        str(MAX_TOKENS),
        "--json",
        *(["--interleave"] if interleave else []),
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=540)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(out.strip().splitlines()[-1])
    assert set(results) == {"colocated", *pd}
    for name in ("colocated", *pd):
        r = results[name]
        assert r["ok"] and r["error"] is None, (name, r["error"])
        assert r["requests"] == len(LENGTHS) and r["mismatches"] == 0 and r["failed_requests"] == 0
        for key in REQUIRED:
            assert key in r, (name, key)
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["ttft_mean_ms"] > 0
        assert r["cpu_ms_per_request"] > 0, (name, "the servers' CPU time was not measured")
        assert r["e2e_mean_ms"] >= r["ttft_mean_ms"]
        assert sorted(int(k) for k in r["ttft_by_length_ms"]) == list(LENGTHS)
    # tiny model: 1 KiB of KV per token (2 layers x K,V x 2 heads x 32 x float32), whole blocks of 32 tokens
    kv_floor = sum(n // 32 * 32 for n in LENGTHS) * 1024
    for name in pd:
        r = results[name]
        assert r["kv_bytes"] >= kv_floor and r["gbps"] > 0, (name, r["kv_bytes"], r["gbps"])
        assert r["kv_loaded_tokens"] >= sum(LENGTHS) // 2
        colocated_ttft = results["colocated"]["ttft_mean_ms"]
        assert r["vs_colocated"]["ttft_mean_ms"] == pytest.approx(r["ttft_mean_ms"] / colocated_ttft, rel=1e-2)
    assert results["colocated"]["kv_bytes"] is None and results["colocated"]["gbps"] is None
    if "builtin-nixl" in pd:
        ours, builtin = results["ours-nixl-pull"], results["builtin-nixl"]
        assert ours["vs_builtin"]["ttft_mean_ms"] == pytest.approx(ours["ttft_mean_ms"] / builtin["ttft_mean_ms"], rel=1e-2)
    assert "TTFT" in out and "ratios" in out
