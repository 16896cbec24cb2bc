"""Fault benchmark: the same fault scenarios against our NixlConnector and vLLM's built-in NixlConnector, on
the tiny model: how each ends (freed, failed, hung, exited) and after how many seconds, each within a deadline.

Scenarios (a warm 1P1D pair per connector: D has loaded one prompt from the current P; P is replaced after a
scenario that kills or freezes it):
  d-never-comes             P answers a prefill, no D request follows: seconds until P frees the blocks it holds
                            (vllm:kv_cache_usage_perc on P's /metrics back to 0)
  p-killed                  P answers, is SIGKILLed, then D gets the request with P's kv_transfer_params: seconds
                            until D's request ends and how; then whether D serves a plain request correctly
  p-frozen                  as p-killed with SIGSTOP (P is killed afterwards)
  side-channel-port-in-use  a D whose side-channel port another socket holds: seconds until it exits with an error
  d-aborted                 P answers; D gets the request while busy with another (D runs one sequence at a
                            time, so the request waits in D's queue) and the client closes the connection:
                            seconds until P frees the blocks
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from benchmarks.e2e.configs import ServerSettings, settings_for
from benchmarks.faults.scenarios import (
    BUSY_MIN_TOKENS,
    BUSY_PROMPT_TOKENS,
    D_MAX_NUM_SEQS,
    MAX_TOKENS,
    RUN_ORDER,
    SCENARIOS,
    Connector,
    Kind,
    Outcome,
    Pair,
    connectors,
)
from benchmarks.host import machine
from kvc_testing.tiny_model import build_tiny_model

logger = logging.getLogger("bench_faults")

CONNECTOR_NAMES = ("ours", "builtin")


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--{what}: unknown or none {unknown}; known: {', '.join(known)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, from: {', '.join(SCENARIOS)}")
    ap.add_argument("--connectors", default=",".join(CONNECTOR_NAMES), help=f"comma-separated, from: {', '.join(CONNECTOR_NAMES)}")
    ap.add_argument(
        "--deadline-s", type=float, default=60.0, help="longest wait for each outcome; past it the outcome is reported as '> N s'"
    )
    ap.add_argument("--prompt-tokens", type=int, default=200, help="prompt length (P holds its blocks for D)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--verbose", action="store_true", help="log server start-up and stops")
    args = ap.parse_args(argv)
    try:
        args.scenario_names = _names(args.scenarios, list(SCENARIOS), "scenarios")
        args.connector_names = _names(args.connectors, CONNECTOR_NAMES, "connectors")
    except ValueError as e:
        ap.error(str(e))
    if args.deadline_s <= 0 or args.prompt_tokens < 33:
        ap.error("--deadline-s must be > 0 and --prompt-tokens >= 33 (more than one block)")
    return args


def run_scenario(name: str, pair: Pair) -> Outcome:
    """One scenario; a failure of the benchmark itself (a server that does not start...) becomes an ERROR outcome."""
    t0 = time.monotonic()
    try:
        outcome = SCENARIOS[name](pair)
    except (RuntimeError, httpx.HTTPError, OSError, KeyError, ValueError) as e:
        logger.exception("%s / %s failed", pair.connector.name, name)
        pair.retire_p()  # in an unknown state
        outcome = Outcome(Kind.ERROR, None, " ".join(f"{type(e).__name__}: {e}".split())[:400])
    wall = round(time.monotonic() - t0, 1)
    return Outcome(outcome.kind, outcome.seconds, outcome.detail, {**outcome.data, "scenario_wall_s": wall}, outcome.tag)


def run_connector(
    connector: Connector, settings: ServerSettings, names: Sequence[str], deadline_s: float, prompt_tokens: int
) -> dict[str, Outcome]:
    """Every chosen scenario on one connector; its servers are all stopped when this returns."""
    results: dict[str, Outcome] = {}
    with contextlib.ExitStack() as stack:
        pair = Pair(connector, settings, stack, deadline_s, prompt_tokens)
        for name in (n for n in RUN_ORDER if n in names):
            print(f"{connector.name} / {name} ...", flush=True)
            results[name] = run_scenario(name, pair)
            print(f"    {results[name].cell(deadline_s)}: {results[name].detail}", flush=True)
    return results


def table(results: dict[str, dict[str, Outcome]], scenarios: Sequence[str], conns: Sequence[str], deadline_s: float) -> str:
    rows = [["scenario", *conns]]
    rows += [[s, *(results[c][s].cell(deadline_s) for c in conns)] for s in scenarios]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def report(results: dict[str, dict[str, Outcome]], args: argparse.Namespace, conns: dict[str, Connector]) -> None:
    print(f"\noutcome and seconds per scenario (deadline {args.deadline_s:g} s)")
    print(table(results, args.scenario_names, args.connector_names, args.deadline_s))
    print("\ndetails")
    for s in args.scenario_names:
        for c in args.connector_names:
            print(f"  {s} / {c}: {results[c][s].detail}")
    for c in args.connector_names:
        lease = conns[c].lease
        print(f"note ({c}): {conns[c].description}; default lease {lease.seconds} s from {lease.source}")


def to_json(
    results: dict[str, dict[str, Outcome]], args: argparse.Namespace, conns: dict[str, Connector], host: str, wall_s: float
) -> dict[str, Any]:
    return {
        "deadline_s": args.deadline_s,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": MAX_TOKENS,
        "d_max_num_seqs": D_MAX_NUM_SEQS,
        "host": host,
        "wall_s": round(wall_s, 1),
        "connectors": {
            c: {
                "description": conns[c].description,
                "lease_default_s": conns[c].lease.seconds,
                "lease_source": conns[c].lease.source,
            }
            for c in args.connector_names
        },
        "results": {s: {c: results[c][s].to_json() for c in args.connector_names} for s in args.scenario_names},
    }


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)  # unwinds: every server's process group is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    host = machine()
    conns = connectors()
    model = build_tiny_model()
    # Long enough for d-aborted's busy request on D (and for the prompt plus its output).
    settings = settings_for(model, "tiny", max(args.prompt_tokens, BUSY_PROMPT_TOKENS), max(MAX_TOKENS, BUSY_MIN_TOKENS), 1)
    print(f"bench_faults {datetime.datetime.now().isoformat(timespec='seconds')} on {host}")
    print(
        f"tiny model, prompt {args.prompt_tokens} tokens, {MAX_TOKENS} output tokens, deadline {args.deadline_s:g} s; "
        f"scenarios {', '.join(args.scenario_names)}; connectors {', '.join(args.connector_names)}"
    )
    print(
        f"each connector: P and D (module-path form for ours; D with --max-num-seqs {D_MAX_NUM_SEQS}), D loads one "
        "prompt from every new P before its scenario (a warm pair); a P killed or frozen is replaced"
    )
    for c in args.connector_names:
        print(f"{c}: default lease {conns[c].lease.seconds} s ({conns[c].lease.source})", flush=True)
    t0 = time.monotonic()
    results = {
        c: run_connector(conns[c], settings, args.scenario_names, args.deadline_s, args.prompt_tokens) for c in args.connector_names
    }
    wall = time.monotonic() - t0
    report(results, args, conns)
    print(f"wall time {wall:.0f} s")
    if args.json:
        print(json.dumps(to_json(results, args, conns, host, wall)), flush=True)
    errors = [(c, s) for c in results for s, o in results[c].items() if o.kind is Kind.ERROR]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
