"""`python -m benchmarks.faults.bench_faults` on our connector: a killed producer fails D's request well within the deadline and
D keeps serving; a D request aborted while queued frees P's blocks at once (not at lease expiry); a side-channel
port in use stops start-up with a message naming the port."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60
SCENARIOS = ("d-aborted", "p-killed", "side-channel-port-in-use")

pytestmark = pytest.mark.timeout(480)


def test_bench_faults_measures_our_connector():
    argv = [
        sys.executable,
        "-m",
        "benchmarks.faults.bench_faults",
        "--connectors",
        "ours",
        "--scenarios",
        ",".join(SCENARIOS),
        "--deadline-s",
        str(DEADLINE_S),
        "--json",
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=420)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.strip().splitlines()[-1])
    assert report["deadline_s"] == DEADLINE_S and list(report["connectors"]) == ["ours"]
    assert set(report["results"]) == set(SCENARIOS)

    killed = report["results"]["p-killed"]["ours"]
    # D's request with a dead P's params ends in an error (HTTP 5xx or finish_reason error), not a hang...
    assert killed["outcome"] == "failed" and not killed["timed_out"], killed
    assert 0 < killed["seconds"] < DEADLINE_S, killed
    assert killed["d_request"].startswith("HTTP 5") or "finish_reason error" in killed["d_request"], killed
    # ...counted as one failed load, and D then answers a plain request as P would.
    assert killed["d_counters"]["failed"] == 1, killed
    assert killed["d_serves_plain"] is True and killed["d_alive"] is True, killed

    aborted = report["results"]["d-aborted"]["ours"]
    # The request really waited in D's queue and was dropped at the close; P freed on D's notice, not the lease
    # (it used to wait for the lease: the scheduler had never looked at the queued request).
    assert aborted["queued_on_d"] and aborted["d_dropped_it"], aborted
    assert aborted["outcome"] == "freed" and aborted["tag"] == "D's notice", aborted
    assert aborted["leases_expired"] == 0 and aborted["seconds"] < report["connectors"]["ours"]["lease_default_s"] / 3, aborted

    busy = report["results"]["side-channel-port-in-use"]["ours"]
    assert busy["outcome"] == "exited" and busy["exit_code"] not in (0, None), busy
    assert 0 < busy["seconds"] < DEADLINE_S, busy
    message = busy["error_in_log"] or ""
    assert "SideChannelBindError" in message and str(busy["port"]) in message, busy

    table = out[out.index("outcome and seconds per scenario") :]
    assert "p-killed" in table and "side-channel-port-in-use" in table and "failed (HTTP" in table
