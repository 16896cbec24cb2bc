"""Idle CPU soak: a long-lived P and D (our NIXL connector, the tiny model) serve while short-lived peers
come and go, and after each step both stand idle for --idle-s while their CPU is counted (the whole
process group of each: API server, engine, workers, UCX threads).

Steps, repeated --rounds times:
  pull-d          a short-lived D reads 3 prompts from the long P, then stops (SIGTERM)
  killed-d        a short-lived D reads 3 prompts from the long P, then is SIGKILLed
  push-d          a short-lived D in push mode gets 3 prompts written by the long P, then is SIGKILLed
  killed-p        the long D reads 3 prompts from a short-lived P, which is then SIGKILLed
  frozen-p        a short-lived P answers a prefill and is SIGSTOPped; the long D's request for it fails
                  at D's handshake deadline; the P is SIGKILLed

An idle P or D uses a few percent of a core. One that keeps a core busy after a step is the defect
docs/troubleshooting.md describes ("an idle P or D keeps one core busy"); the report says after which
step each first went over --limit cores.

    python -m benchmarks.faults.bench_idle [--rounds 3] [--idle-s 5] [--limit 0.5] [--extra-config JSON] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.host import machine
from kvc_testing.cluster import generate, make_prompts, pd_server, prefill
from kvc_testing.procs import VllmServer, group_cores, running
from kvc_testing.tiny_model import build_tiny_model

MAX_MODEL_LEN = 512
MAX_TOKENS = 4
PROMPTS = 3
D_DEADLINES = {"handshake_timeout_s": 5, "transfer_timeout_s": 10}
STEPS = ("pull-d", "killed-d", "push-d", "killed-p", "frozen-p")


@dataclass
class Long:
    """The long-lived pair, and what the steps start beside it."""

    model: Path
    config: dict[str, Any]
    p: VllmServer
    d: VllmServer
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        self.seed += 1
        return make_prompts([150] * PROMPTS, seed=1000 + self.seed)

    @contextlib.contextmanager
    def short(self, role: str, name: str, extra: dict[str, Any] | None = None) -> Iterator[VllmServer]:
        config = {**self.config, **(D_DEADLINES if role == "kv_consumer" else {}), **(extra or {})}
        with pd_server(self.model, role, name=name, max_model_len=MAX_MODEL_LEN, extra_config=config) as server:
            yield server


def _serve(p: VllmServer, d: VllmServer, prompts: list[list[int]]) -> int:
    """Prefill on p, decode on d with its kv_transfer_params; how many answered 200."""
    ok = 0
    for prompt in prompts:
        r = generate(d.url, prompt, MAX_TOKENS, kv_transfer_params=prefill(p.url, prompt))
        ok += r.status_code == 200
    return ok


def _kill(server: VllmServer) -> None:
    if server.pgid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pgid, signal.SIGKILL)


def _step(long: Long, step: str) -> str:
    """Run one step; a short description of what happened."""
    if step in ("pull-d", "killed-d", "push-d"):
        extra = {"mode": "push"} if step == "push-d" else {}
        with long.short("kv_consumer", f"D-{step}", extra) as d:
            served = _serve(long.p, d, long.prompts())
            if step != "pull-d":
                _kill(d)
        return f"{served}/{PROMPTS} served"
    if step == "killed-p":
        with long.short("kv_producer", "P-killed") as p:
            served = _serve(p, long.d, long.prompts())
            _kill(p)
        return f"{served}/{PROMPTS} served"
    if step == "frozen-p":
        with long.short("kv_producer", "P-frozen") as p:
            prompt = long.prompts()[0]
            params = prefill(p.url, prompt)
            assert p.pgid is not None
            os.killpg(p.pgid, signal.SIGSTOP)
            r = generate(long.d.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=60)
            _kill(p)
        return f"request for the frozen P: {r.status_code}"
    raise ValueError(f"unknown step {step!r}")


def idle_cores(servers: Sequence[VllmServer], seconds: float) -> list[float]:
    """The cores each server's process group used over the same `seconds` of standing idle."""
    return [round(cores, 3) for cores in group_cores(servers, seconds)]


def first_over(rows: Sequence[dict[str, Any]], key: str, limit: float) -> str | None:
    """The step (round:step) after which rows[key] first went over limit, or None."""
    for row in rows:
        if row[key] > limit:
            return f"{row['round']}:{row['step']}"
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = build_tiny_model()
    config = json.loads(args.extra_config)
    rows: list[dict[str, Any]] = []
    t_start = time.monotonic()
    p = pd_server(model, "kv_producer", name="P-long", max_model_len=MAX_MODEL_LEN, extra_config=config)
    d = pd_server(model, "kv_consumer", name="D-long", max_model_len=MAX_MODEL_LEN, extra_config={**config, **D_DEADLINES})
    with running(p, d):
        long = Long(model, config, p, d)
        _serve(p, d, long.prompts())
        p_cores, d_cores = idle_cores([p, d], args.idle_s)
        rows.append({"round": 0, "step": "start", "what": "3 prompts P -> D", "p_cores": p_cores, "d_cores": d_cores, "at_s": 0.0})
        for rnd in range(1, args.rounds + 1):
            for step in STEPS:
                what = _step(long, step)
                p_cores, d_cores = idle_cores([p, d], args.idle_s)
                at = round(time.monotonic() - t_start, 1)
                rows.append({"round": rnd, "step": step, "what": what, "p_cores": p_cores, "d_cores": d_cores, "at_s": at})
                if not args.json:
                    idle = f"P {p_cores:.2f} cores, D {d_cores:.2f} cores"
                    print(f"round {rnd} {step:9s} {what:28s} idle: {idle} ({at:.0f} s)", flush=True)
    return {
        "benchmark": "bench_idle",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "config": config,
        "idle_s": args.idle_s,
        "limit_cores": args.limit,
        "steps": rows,
        "p_max_cores": max(r["p_cores"] for r in rows),
        "d_max_cores": max(r["d_cores"] for r in rows),
        "p_first_over": first_over(rows, "p_cores", args.limit),
        "d_first_over": first_over(rows, "d_cores", args.limit),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=5.0, help="how long P and D stand idle after each step")
    ap.add_argument("--limit", type=float, default=0.5, help="cores an idle server may use (report only)")
    ap.add_argument("--extra-config", default="{}", help="our connector's config for every server, JSON")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a line per step")
    args = ap.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"idle P at most {result['p_max_cores']} cores (first over {args.limit}: {result['p_first_over']}), "
            f"idle D at most {result['d_max_cores']} cores (first over: {result['d_first_over']})"
        )
    return 0 if result["p_first_over"] is None and result["d_first_over"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
