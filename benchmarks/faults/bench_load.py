"""Load with faults: 2 P + 2 D (NIXL, params flow, the users' default deadlines) behind the proxy, the tiny
model, mixed requests (completions by ids and by text, chat; half streamed) at a fixed concurrency, checked
against a colocated server; meanwhile P1's and D1's side channels are fuzzed, P2 is frozen (SIGSTOP) for
--freeze-s and D2 is killed and restarted on its ports (--no-faults: none of that). Once every fault is
over, --after more requests run (the restarted D2 among the backends; it must serve some of them) and
every P and D rank's side channel must answer a stats request.

Reports wrong answers, lost requests (no clear answer), errors, latency p50/p90/p99/max, and where the
slowest requests waited: the proxy's own line per request (P's answer, D's first byte, retries, the
backends tried) and D's line per KV load (queue, handshake, read, claim), for the slowest 1% and for all.

    python -m benchmarks.faults.bench_load [--requests 300] [--concurrency 24] [--freeze-s 12] [--after 48] [--no-faults] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.host import machine
from kv_connectors.errors import KVConnectorError
from kvc_testing.cluster import ENTRY_POINT_FORM, MODULE_FORM, ProxyProcess, pd_server, stats
from kvc_testing.faults import plan as fault_plan
from kvc_testing.load import LoadRun, compare, expected, make_cases, run_load
from kvc_testing.procs import VllmServer
from kvc_testing.tiny_model import build_tiny_model

MAX_MODEL_LEN = 1024
PROXY_ARGS = ("--health-interval-s", "0.5", "--health-timeout-s", "2")
PROXY_LINE = re.compile(
    r"request (?P<id>\S+) \S+ mode=(?P<mode>\S+) seeded=\S+ P=(?P<p>\S+) D=(?P<d>\S+) retries=(?P<retries>\d+) "
    r"status=(?P<status>\d+) outcome=(?P<outcome>\S+) p_answer=(?P<p_answer>\S+) d_first_byte=(?P<d_first>\S+) "
    r"total=(?P<total>[0-9.]+)s(?: hedge=(?P<hedge>\S+))?"
)
LOAD_LINE = re.compile(r"kv load request=(?P<id>\S+) .*?(?P<phases>(?:\w+_ms=[0-9.]+ ?)+)")


class Fleet:
    """The colocated reference, P1, P2, D1, D2 and the proxy, started together and always stopped."""

    def __init__(self, model: Path, d_config: dict[str, Any], hedge_prefill: str = "auto") -> None:
        self.model, self.d_config, self.hedge_prefill = model, d_config, hedge_prefill
        self.reference = VllmServer(model, max_model_len=MAX_MODEL_LEN, name="colocated")
        self.prefill = [self._p(f"P{i}") for i in (1, 2)]
        self.decode = [self._d(f"D{i}") for i in (1, 2)]
        self.proxy: ProxyProcess | None = None
        self.retired: list[VllmServer] = []  # killed D, their logs kept for the breakdown

    def _p(self, name: str) -> VllmServer:
        return pd_server(self.model, "kv_producer", form=MODULE_FORM, name=name, max_model_len=MAX_MODEL_LEN)

    def _d(self, name: str, old: VllmServer | None = None) -> VllmServer:
        ports: dict[str, Any] = {} if old is None else {"port": old.port, "side_channel_port": old.side_channel_port}  # type: ignore[attr-defined]
        return pd_server(
            self.model,
            "kv_consumer",
            form=ENTRY_POINT_FORM,
            name=name,
            max_model_len=MAX_MODEL_LEN,
            extra_config=self.d_config,
            **ports,
        )

    def restart_decode(self, old: VllmServer) -> VllmServer:
        i = self.decode.index(old)
        self.retired.append(old)
        new = self._d(old.name, old)
        self.decode[i] = new
        new.start()
        return new.wait_ready()

    @contextlib.contextmanager
    def running(self) -> Iterator[Fleet]:
        servers = [self.reference, *self.prefill, *self.decode]
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready()
            proxy_args = (*PROXY_ARGS, "--hedge-prefill", self.hedge_prefill)
            self.proxy = ProxyProcess([p.url for p in self.prefill], [d.url for d in self.decode], extra_args=proxy_args)
            self.proxy.start()
            self.proxy.wait_ready()
            yield self
        finally:
            for proc in [self.proxy, self.reference, *self.prefill, *self.decode]:
                if proc is not None:
                    proc.stop()

    def logs(self, servers: Sequence[VllmServer | ProxyProcess | None]) -> str:
        return "".join(s.log_path.read_text(errors="replace") for s in servers if s is not None and s.log_path.exists())


@dataclass(frozen=True)
class ProxyLine:
    request_id: str
    total_s: float
    p_answer_s: float | None
    d_first_s: float | None
    retries: int
    prefill: str
    decode: str
    outcome: str
    hedge: str = "-"  # a hedged prefill: won (the second P answered first) or lost


def _seconds(text: str) -> float | None:
    return None if text in ("-", "None") else float(text.rstrip("s"))


def proxy_lines(log: str) -> list[ProxyLine]:
    return [
        ProxyLine(
            m["id"],
            float(m["total"]),
            _seconds(m["p_answer"]),
            _seconds(m["d_first"]),
            int(m["retries"]),
            m["p"],
            m["d"],
            m["outcome"],
            m["hedge"] or "-",
        )
        for m in PROXY_LINE.finditer(log)
    ]


def load_phases(log: str) -> dict[str, dict[str, float]]:
    """D's phases (ms) per vLLM request id, from its 'kv load' lines."""
    out: dict[str, dict[str, float]] = {}
    for m in LOAD_LINE.finditer(log):
        out[m["id"]] = {k: float(v) for k, v in (kv.split("=") for kv in m["phases"].split())}
    return out


def _median(xs: Sequence[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def breakdown(lines: Sequence[ProxyLine], loads: dict[str, dict[str, float]], names: dict[str, str]) -> dict[str, Any]:
    """Medians of each phase over `lines` (seconds), how many were retried, and which backends they used
    (`names`: URL -> server name)."""

    def d_phases(line: ProxyLine) -> dict[str, float]:
        return next((v for k, v in loads.items() if line.request_id in k), {})

    phases = [d_phases(line) for line in lines]
    used: dict[str, int] = {}
    for line in lines:
        for url in {*line.prefill.split(","), *line.decode.split(",")}:
            name = names.get(url.rstrip("!"), url) + ("!" if url.endswith("!") else "")
            used[name] = used.get(name, 0) + 1
    return {
        "requests": len(lines),
        "total_s": _median([line.total_s for line in lines]),
        "p_answer_s": _median([line.p_answer_s for line in lines if line.p_answer_s is not None]),
        "p_answer_to_d_first_byte_s": _median(
            [line.d_first_s - line.p_answer_s for line in lines if line.d_first_s is not None and line.p_answer_s is not None]
        ),
        "after_first_byte_s": _median([line.total_s - line.d_first_s for line in lines if line.d_first_s is not None]),
        "retried": sum(line.retries > 0 for line in lines),
        "d_load_ms": {
            k: _median([p[k] for p in phases if k in p]) for k in sorted({k for p in phases for k in p}) if k != "transfer_ms"
        },
        "backends_used": dict(sorted(used.items())),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model = build_tiny_model()
    fleet = Fleet(model, json.loads(args.d_config), args.hedge_prefill)
    with fleet.running():
        assert fleet.proxy is not None
        cases = make_cases(args.requests, seed=args.seed, max_tokens=args.max_tokens)
        want = expected(fleet.reference, cases)
        countdown, faults = fault_plan(fleet, args.requests, freeze_s=args.freeze_s) if args.faults else (None, None)
        run: LoadRun = run_load(fleet.proxy.url, cases, args.concurrency, countdown.done if countdown else None)
        if countdown is not None:
            countdown.join(300)
        after = _after_faults(fleet, args)
        wrong = [b for b in compare(cases, run.outcomes, want) if ": error " not in b]
        names = {s.url: s.name for s in [*fleet.prefill, *fleet.decode]}
        lines = sorted(proxy_lines(fleet.logs([fleet.proxy])), key=lambda line: line.total_s)
        loads = load_phases(fleet.logs([*fleet.decode, *fleet.retired]))
        slowest = lines[-max(1, len(lines) // 100) :]
        return {
            "benchmark": "load",
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "requests": args.requests,
            "concurrency": args.concurrency,
            "faults": faults.events if faults else [],
            "fault_problems": faults.problems if faults else [],
            "wall_s": round(run.wall_s, 1),
            "wrong": len(wrong),
            "lost": len(run.lost),
            "errors": len(run.errors),
            "error_messages": sorted({e[:120] for e in run.errors}),
            "p50_s": round(run.percentile(0.5), 3),
            "p90_s": round(run.percentile(0.9), 3),
            "p99_s": round(run.percentile(0.99), 3),
            "max_s": round(run.percentile(1.0), 3),
            "p99_over_p50": round(run.percentile(0.99) / run.percentile(0.5), 2),
            "hedge_prefill": args.hedge_prefill,
            "hedges": {result: sum(line.hedge == result for line in lines) for result in ("won", "lost")},
            "slowest_1pct": breakdown(slowest, loads, names),
            "all": breakdown(lines, loads, names),
            "wrong_examples": wrong[:3],
            "after_faults": after,
        }


def _after_faults(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """The fleet once every fault is over: --after requests (wrong, lost, errors, how many of them the
    restarted D2 served) and each server's side channel answering stats."""
    d2 = fleet.decode[1]
    before = d2.log_path.read_text(errors="replace").count("kv load request=") if d2.log_path.exists() else 0
    cases = make_cases(args.after, seed=args.seed + 1, max_tokens=args.max_tokens)
    want = expected(fleet.reference, cases)
    assert fleet.proxy is not None
    run = run_load(fleet.proxy.url, cases, args.concurrency)
    bad = compare(cases, run.outcomes, want)
    side_channels: dict[str, str] = {}
    for server in [*fleet.prefill, *fleet.decode]:
        try:
            reply = stats(server, timeout_s=10.0)
            side_channels[server.name] = f"answered (engine {reply.engine_id})"
        except KVConnectorError as e:
            side_channels[server.name] = f"no answer: {e}"
    return {
        "requests": args.after,
        "wrong": sum(": error " not in b for b in bad),
        "lost": len(run.lost),
        "errors": len(run.errors),
        "served_by_restarted_d2": d2.log_path.read_text(errors="replace").count("kv load request=") - before,
        "side_channels": side_channels,
    }


def after_ok(after: dict[str, Any]) -> bool:
    """The fleet recovered: nothing wrong or lost after the faults, the restarted D2 served, every side channel answered."""
    return (
        after["wrong"] == 0
        and after["lost"] == 0
        and (after["requests"] == 0 or after["served_by_restarted_d2"] > 0)
        and all(v.startswith("answered") for v in after["side_channels"].values())
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--freeze-s", type=float, default=12.0, help="how long P2 stays frozen")
    ap.add_argument("--after", type=int, default=48, help="requests run once every fault is over")
    ap.add_argument("--no-faults", dest="faults", action="store_false", help="the same load with no fault")
    ap.add_argument("--d-config", default="{}", help="our connector's config for D, JSON (default: the defaults)")
    ap.add_argument("--hedge-prefill", default="auto", help="the proxy's --hedge-prefill (auto, off, or seconds)")
    ap.add_argument("--seed", type=int, default=55)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    args = ap.parse_args(argv)
    if args.requests < 20 or args.concurrency < 1:
        ap.error("--requests must be >= 20 (the faults come at 5-35%%) and --concurrency >= 1")
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['requests']} requests at concurrency {result['concurrency']} in {result['wall_s']} s: "
            f"{result['wrong']} wrong, {result['lost']} lost, {result['errors']} errors; p50 {result['p50_s']} s, "
            f"p99 {result['p99_s']} s ({result['p99_over_p50']}x), max {result['max_s']} s; "
            f"hedged prefills ({result['hedge_prefill']}): {result['hedges']}"
        )
        print(f"faults: {result['faults']} {result['fault_problems'] or ''}")
        print(f"slowest 1%: {json.dumps(result['slowest_1pct'])}")
        print(f"all:        {json.dumps(result['all'])}")
        print(f"after the faults: {json.dumps(result['after_faults'])}")
    ok = result["wrong"] == 0 and result["lost"] == 0 and not result["fault_problems"] and after_ok(result["after_faults"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
