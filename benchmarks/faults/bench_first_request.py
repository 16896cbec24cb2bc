"""The first request after start-up, on a loaded host: for each shape that takes a handshake between unlike
servers, with every deadline at its default (P's lease, D's handshake and transfer timeouts), a fresh P
and D, one request through the proxy and then a second; each answer must equal the colocated server's.
Servers are not pinned to cores (as users run them), and the host is loaded: a busy-looping process per
core, at the servers' priority, from just before the first request until after the second (where a 30 s
stall was seen: D's handshake or connect outlived P's lease while P's and D's processes fought for two
cores). A reproduction, minutes long: a benchmark, not part of `make test` (whose every module's first
request is a fresh pair's on a quiet host).

Reports each request's seconds and where the first one's time went (D's handshake and load lines, P's
push lines); exit 1 if any answer differs or fails.

    python -m benchmarks.faults.bench_first_request [--shapes NAME,...] [--rounds 1] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.host import machine
from kvc_testing.cluster import ENTRY_POINT_FORM, MODULE_FORM, ProxyProcess, generate, make_prompts, output_ids, pd_server, stats
from kvc_testing.procs import ManagedProcess, VllmServer
from kvc_testing.tiny_model import build_tiny_model

MAX_MODEL_LEN = 512
MAX_TOKENS = 8
# How many cores the busy loops take: every one of this host's.
LOAD_PROCESSES = os.cpu_count() or 2
LOG_WORDS = ("connected to producer", "kv load request", "kv push request")


@dataclass(frozen=True)
class Shape:
    p: dict[str, Any] = field(default_factory=dict)
    d: dict[str, Any] = field(default_factory=dict)


SHAPES = {
    "p-tp2-to-d-tp1-pull": Shape({"tp": 2}, {}),
    "p-tp1-to-d-tp2-push": Shape({}, {"tp": 2, "extra_config": {"mode": "push"}}),
    "p-block32-to-d-block64-pull": Shape({}, {"block_size": 64}),
}


def parse_shapes(text: str) -> list[str]:
    names = [n for n in text.split(",") if n] or list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise ValueError(f"unknown shape(s) {unknown}; known: {list(SHAPES)}")
    return names


def log_lines(server: VllmServer) -> list[str]:
    """Where a request's time went, from a server's log: handshakes, loads, push writes."""
    text = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
    return [line[-220:] for line in text.splitlines() if any(w in line for w in LOG_WORDS)]


def one_shape(name: str, model: Path, reference: VllmServer, seed: int) -> dict[str, Any]:
    """A fresh P and D of the shape; two requests through the proxy on the loaded host."""
    shape = SHAPES[name]
    prompts = make_prompts([150, 90], seed=seed)
    want = [output_ids(generate(reference.url, prompt, MAX_TOKENS)) for prompt in prompts]
    p = pd_server(model, "kv_producer", form=MODULE_FORM, name="P-first", max_model_len=MAX_MODEL_LEN, **shape.p)
    d = pd_server(model, "kv_consumer", form=ENTRY_POINT_FORM, name="D-first", max_model_len=MAX_MODEL_LEN, **shape.d)
    requests: list[dict[str, Any]] = []
    with contextlib.ExitStack() as servers:
        for server in (p, d):  # both start at once, then both are waited for
            servers.callback(server.stop)
            server.start()
        for server in (p, d):
            server.wait_ready()
        with ProxyProcess([p.url], [d.url]) as proxy, contextlib.ExitStack() as load:
            proxy.wait_ready()
            hogs = [
                load.enter_context(ManagedProcess([sys.executable, "-c", "while True: pass"], name=f"busy-{i}"))
                for i in range(LOAD_PROCESSES)
            ]
            for prompt, expected in zip(prompts, want):
                t0 = time.monotonic()
                r = generate(proxy.url, prompt, MAX_TOKENS, timeout=120)
                seconds = round(time.monotonic() - t0, 2)
                exact = r.status_code == 200 and output_ids(r) == expected
                requests.append(
                    {"status": r.status_code, "exact": exact, "seconds": seconds, "error": "" if exact else r.text[:300]}
                )
            loaded = all(h.is_running() for h in hogs)
        loads = stats(d).recv_transfers
        lines = {server.name: log_lines(server) for server in (p, d)}
    return {"shape": name, "requests": requests, "host_loaded": loaded, "d_loads": loads, "log": lines}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = build_tiny_model()
    rows = []
    with VllmServer(model, max_model_len=MAX_MODEL_LEN, name="colocated") as reference:
        for rnd in range(args.rounds):
            for i, name in enumerate(args.shapes):
                row = {"round": rnd + 1, **one_shape(name, model, reference, seed=4242 + 100 * rnd + i)}
                rows.append(row)
                if not args.json:
                    times = ", ".join(f"{q['seconds']} s{'' if q['exact'] else ' WRONG/FAILED'}" for q in row["requests"])
                    print(f"round {rnd + 1} {name:28s} first, second: {times}; D loads {row['d_loads']}", flush=True)
                    for server, lines in row["log"].items():
                        for line in lines:
                            print(f"  {server}: {line}")
    return {
        "benchmark": "bench_first_request",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "load_processes": LOAD_PROCESSES,
        "runs": rows,
        "failed": [f"{r['round']}:{r['shape']}" for r in rows if not verdict(r)],
    }


def verdict(row: dict[str, Any]) -> bool:
    """Both answers exact, the host loaded throughout, and D loaded both prompts (it computed neither)."""
    return all(q["exact"] for q in row["requests"]) and row["host_loaded"] and row["d_loads"] >= len(row["requests"])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shapes, default=list(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=1, help="fresh pairs per shape")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a line per pair")
    args = ap.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("every first and second request exact" if not result["failed"] else f"FAILED: {result['failed']}")
    return 0 if not result["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
