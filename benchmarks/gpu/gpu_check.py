"""The GPU end-to-end check: one command on one CUDA host (the NVIDIA driver, torch and this checkout;
wheels may be carried in) that installs what it needs, then checks every transport greedy-exact
against a colocated server, the foreign-KV proof, TTFT against vLLM's built-in NixlConnector and
colocated (seeded and unseeded), and staged against direct, and writes one JSON report naming the
step that failed.

    python3 -m benchmarks.gpu.gpu_check [--out DIR] [--wheels DIR] [--python PY] [--steps a,b] [--dry-run]
    make gpu-check GPU_CHECK_ARGS="--out /tmp/gpu"

This module is the orchestrator and imports the standard library only (it runs before anything is
installed): it installs into .venv/gpu-check (two tiers: the transport's packages, then vLLM and
the proxy; where vLLM cannot be installed the transport steps still run), runs the steps
(benchmarks/gpu/steps.py) in a child process under that interpreter with the remaining
budget (default 8 minutes; installing is timed apart), and assembles the report from the child's
events, so that a step that hangs or kills the child is still named. --dry-run runs on any host
with the test dependencies: it builds the whole plan (every server's command line, every check's
call, every subprocess) without starting anything, checks it (config keys, flags, modules, that
the pytest selection is not empty, the GPU memory plan) and writes the report a run would.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "kv-connectors/gpu-check/1"
STATUSES = ("ok", "failed", "skipped", "timeout", "planned")
VENV = ROOT / ".venv" / "gpu-check"
DEFAULT_BUDGET_S = 480.0
# What the checks themselves import beyond kv-connectors' extras (the tiny model, pytest).
CHECK_PACKAGES = ("transformers", "tokenizers", "safetensors", "httpx", "pytest", "pytest-timeout")
APT_PACKAGES = ("libibverbs1", "libnl-3-200", "libnl-route-3-200")  # Mooncake needs them even for TCP
RATIO_KEYS = (
    "ttft_vs_builtin_seeded",
    "ttft_vs_builtin_unseeded",
    "ttft_vs_colocated_seeded",
    "ttft_vs_colocated_unseeded",
    "ttft_seeded_vs_unseeded",
    "ttft_staged_vs_direct",
    "staged_vs_direct_pull",
    "staged_vs_direct_push",
)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the check, in the order they run. tier: what must be installed for it (host: the
    orchestrator's own; transport: torch + NIXL; vllm: everything)."""

    name: str
    what: str
    timeout_s: float
    needs: tuple[str, ...] = ()
    tier: str = "vllm"


STEPS: tuple[Step, ...] = (
    Step("install-transport", "kv-connectors' core and NIXL packages (and Mooncake's system libraries)", 300, tier="host"),
    Step("install-vllm", "vLLM (CUDA), Mooncake, the proxy and the checks' packages; kv-connectors itself", 900, tier="host"),
    Step("host", "the GPU torch sees, nvidia-smi, installed versions", 30, ("install-transport",), "transport"),
    Step("model", "the tiny random-weights model and its perturbed copy", 90, ("host", "install-vllm")),
    # Each check waits for the servers it needs; one that is down skips the check, naming it.
    Step("servers", "colocated, P and D instances of every set-up (processes on one GPU) and their proxies", 240, ("model",)),
    Step("nixl-pull", "NIXL, D pulls: greedy-exact against colocated through the proxy, P frees all", 120, ("model",)),
    Step("nixl-push", "NIXL, P pushes into D: greedy-exact, one write per prompt", 120, ("model",)),
    Step("nixl-layerwise", "NIXL, transfer-id flow, D first: every prompt pushed layer by layer, greedy-exact", 90, ("model",)),
    Step(
        "nixl-layerwise-cudagraphs",
        "as nixl-layerwise with P under vLLM's CUDA graphs (no --enforce-eager): piecewise prefills keep layer-wise",
        180,
        ("model",),
    ),
    Step("staging", "NIXL pull through a bounded host staging pool on both sides: greedy-exact", 120, ("model",)),
    Step("mooncake", "Mooncake, P pushes: greedy-exact against colocated", 120, ("model",)),
    Step("foreign-kv", "a P with perturbed K/V weights changes D's output: D decodes from P's KV", 60, ("model",)),
    Step("ttft", "TTFT: ours against vLLM's built-in NixlConnector and colocated, seeded and unseeded; staged", 150, ("model",)),
    Step("staging-transport-tests", "the CUDA copier and the NIXL staging suite on device KV", 150, ("host",), "transport"),
    Step("staged-vs-direct", "bench_staging on CUDA KV: staged against direct, pull and push", 200, ("host",), "transport"),
)
STEP_NAMES = tuple(s.name for s in STEPS)


# the report ---------------------------------------------------------------------------------------
def step_entry(step: Step, status: str, *, seconds: float | None = None, error: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "name": step.name,
        "what": step.what,
        "status": status,
        "seconds": None if seconds is None else round(seconds, 1),
        "error": error,
        "commands": list(extra.get("commands") or ()),
        "figures": dict(extra.get("figures") or {}),
    }


def assemble(
    results: Mapping[str, Mapping[str, Any]], started: Iterable[str], *, ended_early: str | None, dry_run: bool, budget_s: float
) -> dict[str, Any]:
    """The report from each step's result (as the steps' events carry them): a step that started and
    has no result was running when the child ended (`ended_early`: why); a step neither started
    nor reported did not run, and says why."""
    started = set(started)
    steps: list[dict[str, Any]] = []
    for step in STEPS:
        if step.name in results:
            r = results[step.name]
            steps.append(
                step_entry(
                    step,
                    r["status"],
                    seconds=r.get("seconds"),
                    error=r.get("error"),
                    commands=r.get("commands"),
                    figures=r.get("figures"),
                )
            )
        elif step.name in started:
            status = "timeout" if ended_early and "budget" in ended_early else "failed"
            steps.append(step_entry(step, status, error=f"the checks process ended during this step: {ended_early}"))
        else:
            why = f"not reached: {ended_early}" if ended_early else "not run"
            steps.append(step_entry(step, "skipped", error=why))
    failed = [s["name"] for s in steps if s["status"] in ("failed", "timeout")]
    ttft = next(s for s in steps if s["name"] == "ttft")["figures"].get("ratios") or {}
    staged = next(s for s in steps if s["name"] == "staged-vs-direct")["figures"].get("ratios") or {}
    return {
        "schema": SCHEMA,
        "dry_run": dry_run,
        "finished": datetime.datetime.now().isoformat(timespec="seconds"),
        "budget_s": budget_s,
        "seconds": round(sum(s["seconds"] or 0 for s in steps if not s["name"].startswith("install")), 1),
        "install_seconds": round(sum(s["seconds"] or 0 for s in steps if s["name"].startswith("install")), 1),
        "ok": not failed and all(s["status"] in (("planned",) if dry_run else ("ok",)) for s in steps),
        "failed_step": failed[0] if failed else None,
        "failed_steps": failed,
        "host": next(s for s in steps if s["name"] == "host")["figures"],
        "ratios": {k: {**ttft, **staged}.get(k) for k in RATIO_KEYS},
        "steps": steps,
    }


_REPORT_TYPES: dict[str, type | tuple[type, ...]] = {
    "schema": str,
    "dry_run": bool,
    "finished": str,
    "budget_s": (int, float),
    "seconds": (int, float),
    "install_seconds": (int, float),
    "ok": bool,
    "failed_step": (str, type(None)),
    "failed_steps": list,
    "host": dict,
    "ratios": dict,
    "steps": list,
}
_STEP_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "what": str,
    "status": str,
    "seconds": (int, float, type(None)),
    "error": (str, type(None)),
    "commands": list,
    "figures": dict,
}


def validate_report(report: Mapping[str, Any]) -> list[str]:
    """What is wrong with a report (empty: it has the schema): keys, types, every step once in
    order, statuses, ratios as numbers or null, a failed step named with its error."""
    problems = [f"{k}: missing" for k in _REPORT_TYPES if k not in report]
    problems += [
        f"{k}: {type(report[k]).__name__}" for k, t in _REPORT_TYPES.items() if k in report and not isinstance(report[k], t)
    ]
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"schema {report['schema']!r}, not {SCHEMA!r}")
    names = [s.get("name") for s in report["steps"] if isinstance(s, dict)]
    if names != list(STEP_NAMES):
        problems.append(f"steps {names} are not {list(STEP_NAMES)}")
    for s in report["steps"]:
        if not isinstance(s, dict):
            problems.append(f"step {s!r} is not an object")
            continue
        problems += [f"{s.get('name')}.{k}: missing" for k in _STEP_TYPES if k not in s]
        problems += [
            f"{s.get('name')}.{k}: {type(s[k]).__name__}" for k, t in _STEP_TYPES.items() if k in s and not isinstance(s[k], t)
        ]
        if s.get("status") not in STATUSES:
            problems.append(f"{s.get('name')}.status {s.get('status')!r} is not one of {STATUSES}")
        if s.get("status") in ("failed", "timeout", "skipped") and not s.get("error"):
            problems.append(f"{s.get('name')} is {s.get('status')} without saying why")
    if set(report["ratios"]) != set(RATIO_KEYS) or not all(
        v is None or isinstance(v, (int, float)) for v in report["ratios"].values()
    ):
        problems.append(f"ratios {report['ratios']} are not {RATIO_KEYS} as numbers or null")
    failed = [s["name"] for s in report["steps"] if isinstance(s, dict) and s.get("status") in ("failed", "timeout")]
    if report["failed_steps"] != failed or report["failed_step"] != (failed[0] if failed else None):
        problems.append(f"failed_step(s) {report['failed_step']!r}/{report['failed_steps']} do not name {failed}")
    return problems


def print_summary(report: Mapping[str, Any]) -> None:
    """One line per step (a dry run: and the commands it would run)."""
    for s in report["steps"]:
        took = f" in {s['seconds']:.0f} s" if s["seconds"] is not None else ""
        print(f"  {s['status']:<8} {s['name']:<26}{took}{': ' + s['error'] if s['error'] else ''}")
        for command in s["commands"] if report["dry_run"] else ():
            print(f"             $ {command}")
    shown = {k: v for k, v in report["ratios"].items() if v is not None}
    if shown:
        print("  ratios: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    verdict = "dry run: plan checked" if report["dry_run"] else "every check passed"
    print(verdict if report["ok"] else f"FAILED at step {report['failed_step']}" if report["failed_step"] else "incomplete")


# installing -------------------------------------------------------------------------------------
def pyproject_extras() -> dict[str, list[str]]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {"": list(project.get("dependencies", ())), **project.get("optional-dependencies", {})}


# Run by the host's python3 into the new venv: the host's own site packages after the venv's, also
# where python3 is itself a venv (whose packages --system-site-packages would not see): its torch.
_HOST_SITE = (
    "import pathlib, site, sys; v = sys.version_info; "
    "pathlib.Path(sys.argv[1], 'lib', f'python{v.major}.{v.minor}', 'site-packages', 'kvc_host_site.pth')"
    ".write_text(chr(10).join(site.getsitepackages()) + chr(10))"
)


def install_commands(python: Path, wheels: Path | None) -> dict[str, list[list[str]]]:
    """The commands of each install tier: a venv that sees the host's packages (its torch), the
    transport's packages, then the gpu extra (vLLM for CUDA, CUDA Mooncake), the proxy and the
    checks' packages, and kv-connectors itself (vLLM's entry point, the proxy command)."""
    extras = pyproject_extras()
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if wheels is not None:
        pip += ["--no-index", "--find-links", str(wheels)]
    transport = [*extras[""], *extras.get("nixl", ()), "setuptools>=70.1"]  # setuptools: the editable install
    vllm = [*extras["gpu"], *extras["proxy"], *CHECK_PACKAGES]
    venv = [sys.executable, "-m", "venv", "--system-site-packages", str(VENV)]
    return {
        "install-transport": [venv, [sys.executable, "-c", _HOST_SITE, str(VENV)], [*pip, *transport]],
        "install-vllm": [[*pip, *vllm], [*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)]],
    }


def _missing_apt() -> list[str]:
    if shutil.which("dpkg") is None:
        return []
    return [p for p in APT_PACKAGES if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]


def run_install(step: Step, commands: Sequence[Sequence[str]]) -> dict[str, Any]:
    t0 = time.monotonic()
    notes: list[str] = []
    if step.name == "install-transport" and (missing := _missing_apt()):
        apt = ["apt-get", "install", "-y", "-qq", *missing]
        if os.geteuid() == 0 and shutil.which("apt-get") and subprocess.run(apt, capture_output=True, timeout=120).returncode == 0:
            notes.append(f"apt installed {' '.join(missing)}")
        else:
            notes.append(f"missing system packages {' '.join(missing)}: the Mooncake steps will fail")
    for cmd in commands:
        left = step.timeout_s - (time.monotonic() - t0)
        try:
            done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=max(1.0, left), cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "seconds": time.monotonic() - t0, "error": f"{cmd[:4]} ran past {step.timeout_s:g} s"}
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"status": "failed", "seconds": time.monotonic() - t0, "error": f"{' '.join(cmd[:6])}...: {' | '.join(tail)}"}
    return {"status": "ok", "seconds": time.monotonic() - t0, "figures": {"notes": notes}}


# the checks' child process --------------------------------------------------------------------------
def run_child(python: str, args: argparse.Namespace, events: Path, timeout_s: float) -> str | None:
    """Run the steps under `python`; None when the child finished, else why it ended early."""
    argv = [python, "-m", "benchmarks.gpu.steps", "--events", str(events), "--out", str(args.out)]
    argv += ["--budget-s", f"{timeout_s:.0f}", "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--dtype", args.dtype]
    argv += ["--steps", ",".join(args.steps)] + (["--dry-run"] if args.dry_run else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = child.wait(timeout=timeout_s + 30)  # the child keeps its own budget; this is the backstop
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGTERM)  # it stops its servers on SIGTERM
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        return f"ran past the budget of {timeout_s:.0f} s"
    return None if rc in (0, 1) else f"exit code {rc}"


def read_events(path: Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    results: dict[str, dict[str, Any]] = {}
    started: list[str] = []
    if path.exists():
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                started.append(event["step"])
            else:
                results[event["step"]] = event["result"]
    return results, started


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu_out"), help="report and logs")
    ap.add_argument("--wheels", type=Path, default=None, help="install from this folder only (default: .whl/ if present)")
    ap.add_argument(
        "--python", default=None, help="run the steps under this interpreter, installing nothing (dry run: .venv's, if any)"
    )
    ap.add_argument(
        "--steps",
        default=",".join(STEP_NAMES),
        help="comma-separated subset (the others are skipped; host, model and servers always run)",
    )
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="for every step but installing")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.04, help="each vLLM server's share of the GPU")
    ap.add_argument("--dtype", default="float32", help="the servers' dtype (float32: vLLM's Triton attention)")
    ap.add_argument("--dry-run", action="store_true", help="build and check the plan and the report; start nothing")
    args = ap.parse_args(argv)
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(args.steps) - set(STEP_NAMES))
    if unknown:
        ap.error(f"unknown steps {unknown}; known: {', '.join(STEP_NAMES)}")
    if args.wheels is None and (ROOT / ".whl").is_dir():
        args.wheels = ROOT / ".whl"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    events = args.out / "gpu_check_events.jsonl"
    by_name = {s.name: s for s in STEPS}
    install: dict[str, dict[str, Any]] = {}  # recorded as events too: the child's steps need them
    # The steps' interpreter: the one installed into; for a dry run this checkout's dev venv (make setup).
    dev = ROOT / ".venv" / "bin" / "python"
    python = args.python or (str(VENV / "bin" / "python") if not args.dry_run else str(dev) if dev.exists() else sys.executable)
    for name, commands in install_commands(VENV / "bin" / "python", args.wheels).items():
        shown = [shlex.join(c) for c in commands]
        if args.dry_run:
            install[name] = {"status": "planned", "commands": shown}
        elif args.python is not None or name not in args.steps:
            install[name] = {"status": "skipped", "error": f"using {args.python}" if args.python else "not selected"}
        else:
            print(f"=== {name}", flush=True)
            install[name] = {**run_install(by_name[name], commands), "commands": shown}
    with events.open("w") as log:
        log.writelines(json.dumps({"event": "end", "step": name, "result": r}) + "\n" for name, r in install.items())
    t0 = time.monotonic()
    ended_early = run_child(python, args, events, args.budget_s) if Path(python).exists() or args.dry_run else f"no {python}"
    results, started = read_events(events)
    report = assemble(results, started, ended_early=ended_early, dry_run=args.dry_run, budget_s=args.budget_s)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    problems = validate_report(report)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"gpu_check report: {args.out / 'gpu_check.json'}")
    print_summary(report)
    for p in problems:
        print(f"report problem: {p}")
    return 0 if report["ok"] and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
