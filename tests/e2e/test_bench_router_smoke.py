"""`python -m benchmarks.router.bench_router` end to end on the tiny model, every scenario small (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def test_bench_router_reports_every_scenario():
    argv = [sys.executable, "-m", "benchmarks.router.bench_router", "--conversations", "2", "--turns", "3", "--context", "64"]
    argv += ["--requests", "3", "--warmup", "1", "--lengths", "64,160", "--json"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    multiturn, short, seed = result["multiturn"], result["short"], result["seed"]
    for arm in ("round_robin", "prefix", "prefix_local"):
        run = multiturn[arm]
        assert run["requests"] == 6 and run["d_loads"] >= 1 and run["kv_bytes_per_request"] > 0, run
        assert 0 < run["p_computed_tokens"] <= run["p_prompt_tokens"] and run["d_computed_tokens"] > 0, run
    # Turns 2 and 3 add 8 output + 32 user tokens to a history D has cached: under --turn-local 64 they
    # go to D alone, so P computes the openings only and D the turns.
    local, prefix = multiturn["prefix_local"], multiturn["prefix"]
    assert local["local_prefills"] == 4 and prefix["local_prefills"] == 0, (local, prefix)
    assert local["p_prompt_tokens"] == 2 * (64 + 32) and local["d_loads"] == 2, local
    assert local["p_computed_tokens"] < prefix["p_computed_tokens"], (local, prefix)
    for arm in ("prefix", "prefix_local"):
        assert multiturn[arm]["vs_round_robin"]["kv_bytes"] > 0 and multiturn[arm]["vs_round_robin"]["ttft"] > 0
    assert short["local_ttft_mean_ms"] > 0 and short["pd_ttft_mean_ms"] > 0
    assert seed["outputs_equal"] is True and seed["first_token_counted"] >= 1, seed
