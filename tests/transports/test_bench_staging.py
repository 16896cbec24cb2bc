"""`python -m benchmarks.transport.bench_staging` on real transports (CPU KV): both variants move verified bytes, pool 1/8."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("transport,mode", [("nixl", "pull"), ("mooncake", "push")])
def test_bench_staging_reports_direct_and_staged(transport: str, mode: str, loopback_env: None) -> None:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.transport.bench_staging",
        "--transport",
        transport,
        "--mode",
        mode,
        "--size-mib",
        "16",
        "--chunk-kib",
        "256,1024",
        "--repeat",
        "2",
        "--json",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kv_bytes"] == 16 << 20 and out["device"] == "cpu"
    variants = out["variants"]
    assert set(variants) == {"direct", "staged-256k", "staged-1024k"}
    for name, v in variants.items():
        assert "error" not in v, v
        assert v["verified"] and v["bytes"] == 16 << 20 and v["gbps"] > 0
        if name != "direct":
            assert v["pool_bytes"] == 2 << 20 and v["pool_fraction_of_kv"] == 0.125
            assert 1 <= v["peak_slots"] <= v["slots"] == (2 << 20) // (v["chunk_kib"] << 10)
            assert v["ratio_to_direct"] == pytest.approx(v["gbps"] / variants["direct"]["gbps"], rel=0.01)
    assert "staged-1024k" in proc.stdout and "of direct" in proc.stdout


def _bench_transport(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "benchmarks.transport.bench_transport", "--transport", "nixl", "--size-mib", "8", *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bench_transport_times_the_staging_pipeline_without_its_copies(loopback_env: None) -> None:
    """--copies skip: the same staged transfer with a copier that moves nothing, said in the output
    and the JSON (never "verified"); the real copies verify their bytes; skip without staging is refused."""
    common = ("--staging", "on", "--pool-mib", "2", "--chunk-kib", "256", "--repeat", "2", "--latency-samples", "1", "--json")
    runs = {copies: _bench_transport(*common, "--copies", copies) for copies in ("real", "skip")}
    for copies, proc in runs.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["staging"] and out["copies"] == copies and out["bytes"] == 8 << 20 and out["gbps"] > 0
        assert out["verified"] is (copies == "real")
    assert "bytes NOT verified" in runs["skip"].stdout and "bytes verified" in runs["real"].stdout
    refused = _bench_transport("--copies", "skip")
    assert refused.returncode != 0 and "needs --staging on" in refused.stderr
