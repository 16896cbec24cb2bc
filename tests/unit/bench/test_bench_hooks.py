"""benchmarks/scheduler/bench_hooks.py runs and reports both roles (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bench_hooks_smoke():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.scheduler.bench_hooks",
            "--requests",
            "8",
            "--steps",
            "2",
            "--prompt-len",
            "100",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["requests"] == 8
    for role in ("decode", "prefill"):
        assert result[role]["p50_us"] > 0 and result[role]["max_us"] >= result[role]["p50_us"]
