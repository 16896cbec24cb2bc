"""The GPU end-to-end check (benchmarks/gpu/gpu_check.py) on this CPU host: its dry run builds and checks
the whole plan and writes the report a GPU run would; the report names the step that failed and
why every later step did not run; a broken plan fails the dry run at the step it belongs to."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from benchmarks.gpu import gpu_check
from benchmarks.gpu import servers as gpu_check_servers
from benchmarks.gpu import steps as gpu_check_steps
from benchmarks.gpu.gpu_check import STEP_NAMES, assemble, validate_report


def test_the_dry_run_checks_its_plan_and_writes_the_report(tmp_path: Path) -> None:
    t0 = time.monotonic()
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    assert time.monotonic() - t0 < 60
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert validate_report(report) == [] and report["ok"] and report["dry_run"] and report["failed_step"] is None
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == list(STEP_NAMES)
    assert all(s["status"] == "planned" and s["commands"] and s["error"] is None for s in steps.values()), steps
    # The order: every transport greedy-exact, then foreign KV, then TTFT, then staged vs direct.
    order = [*gpu_check_steps.CHECKS, "ttft", "staged-vs-direct"]
    assert [n for n in STEP_NAMES if n in order] == order
    assert order[:7] == [
        "nixl-pull",
        "nixl-push",
        "nixl-layerwise",
        "nixl-layerwise-cudagraphs",
        "staging",
        "mooncake",
        "foreign-kv",
    ]

    servers = [c for c in steps["servers"]["commands"] if "vllm.entrypoints.openai.api_server" in c]
    proxies = [c for c in steps["servers"]["commands"] if "kv-connectors-proxy" in c]
    assert len(servers) == len(gpu_check_servers.SERVERS) and len(proxies) == len(gpu_check_servers.PROXIES)
    assert all("--gpu-memory-utilization 0.04" in c and "--dtype float32" in c for c in servers)
    assert sum("--enforce-eager" not in c for c in servers) == 1  # P under vLLM's CUDA graphs
    assert sum('"kv_buffer_device": "cuda"' in c for c in servers) == 2  # vLLM's built-in, on the GPU
    assert sum("--no-first-token-from-prefill" in c for c in proxies) == 2  # unseeded: ours and the built-in
    assert {c.split(":")[0] for c in steps["ttft"]["commands"]} >= {"colocated", "ours-seeded", "ours-unseeded", "builtin-seeded"}
    install = steps["install-transport"]["commands"] + steps["install-vllm"]["commands"]
    assert "-m venv --system-site-packages" in install[0] and install[-1].endswith(
        f"--no-deps --no-build-isolation -e {gpu_check.ROOT}"
    )
    assert any("vllm" in c for c in steps["install-vllm"]["commands"])


def test_a_broken_plan_fails_the_dry_run_at_its_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistyped extra-config key in one server's plan is found without a GPU, as start-up would."""
    servers = gpu_check_servers.SERVERS
    bad = [dataclasses.replace(s, extra={**s.extra, "layerwize": False}) if s.key == "P-staged" else s for s in servers]
    monkeypatch.setattr(gpu_check_servers, "SERVERS", tuple(bad))
    events = tmp_path / "events.jsonl"
    assert gpu_check_steps.main(["--events", str(events), "--out", str(tmp_path), "--budget-s", "60", "--dry-run"]) == 1
    results, started = gpu_check.read_events(events)
    report = assemble(results, started, ended_early=None, dry_run=True, budget_s=60)
    assert report["failed_step"] == "servers" and not report["ok"] and validate_report(report) == []
    assert "P-staged" in report["steps"][STEP_NAMES.index("servers")]["error"]
    assert "layerwize" in report["steps"][STEP_NAMES.index("servers")]["error"]


def _ok(name: str) -> dict:
    return {"status": "ok", "seconds": 1.0, "commands": [name], "figures": {}}


def test_the_report_names_the_failed_step_and_why_the_rest_did_not_run() -> None:
    before = STEP_NAMES[: STEP_NAMES.index("nixl-push")]
    results = {n: _ok(n) for n in before}
    results["nixl-push"] = {"status": "failed", "seconds": 3.0, "error": "AssertionError: PD output differs"}
    started = [*before, "nixl-push", "nixl-layerwise"]  # the child was killed during nixl-layerwise
    report = assemble(results, started, ended_early="ran past the budget of 480 s", dry_run=False, budget_s=480)
    assert validate_report(report) == [] and not report["ok"]
    assert report["failed_step"] == "nixl-push" and report["failed_steps"] == ["nixl-push", "nixl-layerwise"]
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["nixl-layerwise"]["status"] == "timeout" and "budget" in steps["nixl-layerwise"]["error"]
    later = STEP_NAMES[STEP_NAMES.index("nixl-layerwise") + 1 :]
    assert all(steps[n]["status"] == "skipped" and "not reached" in steps[n]["error"] for n in later)
    assert report["seconds"] == 7.0 and report["install_seconds"] == 2.0  # install apart


def test_the_report_carries_the_measured_ratios() -> None:
    results = {n: _ok(n) for n in STEP_NAMES}
    results["ttft"]["figures"] = {"ratios": {"ttft_vs_builtin_seeded": 0.8, "ttft_vs_colocated_seeded": 1.3}}
    results["staged-vs-direct"]["figures"] = {"ratios": {"staged_vs_direct_pull": 0.92}}
    report = assemble(results, STEP_NAMES, ended_early=None, dry_run=False, budget_s=480)
    assert report["ok"] and validate_report(report) == []
    assert report["ratios"]["ttft_vs_builtin_seeded"] == 0.8 and report["ratios"]["staged_vs_direct_pull"] == 0.92
    assert report["ratios"]["ttft_vs_builtin_unseeded"] is None


def test_a_report_off_its_schema_is_found_out() -> None:
    good = assemble({n: _ok(n) for n in STEP_NAMES}, STEP_NAMES, ended_early=None, dry_run=False, budget_s=480)
    assert validate_report(good) == []
    assert validate_report({k: v for k, v in good.items() if k != "ratios"}) == ["ratios: missing"]
    silent = json.loads(json.dumps(good))
    silent["steps"][3]["status"] = "failed"  # failed without saying why, and not named as the failed step
    problems = validate_report(silent)
    assert any("without saying why" in p for p in problems) and any("do not name" in p for p in problems)
    shuffled = json.loads(json.dumps(good))
    shuffled["steps"].reverse()
    assert any("are not" in p for p in validate_report(shuffled))


def test_a_step_is_failed_timed_out_or_skipped_by_what_happens_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse
    import contextlib

    args = argparse.Namespace(dry_run=False, steps=list(STEP_NAMES), budget_s=60)
    ctx = gpu_check_servers.Ctx(args, contextlib.ExitStack())
    step = next(s for s in gpu_check.STEPS if s.name == "staged-vs-direct")
    ok = {"host": {"status": "ok"}}

    def boom(ctx):
        raise AssertionError("staged bytes differ")

    def slow(ctx):
        time.sleep(5)

    def down(ctx):
        raise gpu_check_servers.Skip("server P is not up: exited with code 1")

    for impl, status, said in ((boom, "failed", "staged bytes differ"), (slow, "timeout", "ran past"), (down, "skipped", "not up")):
        monkeypatch.setitem(gpu_check_steps.IMPLS, step.name, impl)
        fast = dataclasses.replace(step, timeout_s=0.2)
        r = gpu_check_steps.run_step(ctx, fast, ok, time.monotonic() + 60)
        assert r["status"] == status and said in r["error"], r
    r = gpu_check_steps.run_step(ctx, step, {"host": {"status": "failed"}}, time.monotonic() + 60)
    assert r["status"] == "skipped" and "needs host" in r["error"]
    r = gpu_check_steps.run_step(ctx, step, ok, time.monotonic() - 1)
    assert r["status"] == "skipped" and "budget" in r["error"]


def test_only_the_servers_the_selected_steps_need_are_started() -> None:
    assert gpu_check_steps.needed_servers(["nixl-pull"]) == {"ref", "P", "D-pull"}
    assert gpu_check_steps.needed_servers(["ttft"]) == {"ref", "P", "D-pull", "builtin-P", "builtin-D", "P-staged", "D-staged"}
    assert gpu_check_steps.needed_servers(["staged-vs-direct"]) == set()
    every = gpu_check_steps.needed_servers(list(STEP_NAMES))
    assert every == {s.key for s in gpu_check_servers.SERVERS}, "a server no step uses"


def test_installing_from_carried_wheels_only(tmp_path: Path) -> None:
    commands = gpu_check.install_commands(tmp_path / "py", tmp_path / "wheels")
    pips = [c for cs in commands.values() for c in cs if "pip" in c]
    assert pips and all(c[c.index("--find-links") + 1] == str(tmp_path / "wheels") and "--no-index" in c for c in pips)
