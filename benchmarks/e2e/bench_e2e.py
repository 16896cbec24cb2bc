"""End-to-end PD benchmark: TTFT, latency, tokens/s and KV transfer figures of each 1P1D configuration
(ours, vLLM's built-in NixlConnector) and a colocated server, on the same seeded prompts, as ratios."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.e2e.client import RequestFailed, evaluate, run_load
from benchmarks.e2e.configs import (
    COLOCATED,
    CONFIGS,
    DEFAULT_CONFIGS,
    PdConfig,
    ServerSettings,
    colocated_server,
    parse_configs,
    settings_for,
)
from benchmarks.e2e.stats import (
    Sample,
    add_ratios,
    builtin_baseline,
    by_length_table,
    figures_table,
    kv_figures,
    ratios_table,
)
from benchmarks.host import machine
from kvc_testing.cluster import ProxyProcess, make_prompts, metric, stats
from kvc_testing.procs import VllmServer, running, stop_all
from kvc_testing.tiny_model import (
    MODEL_SIZES,
    build_tiny_model,
    kv_bytes_per_token,
    max_positions,
    weight_bytes,
)

logger = logging.getLogger("bench_e2e")

DEFAULT_LENGTHS = {"tiny": "128,256,512,1024", "small": "128,256,512,1024,2048", "medium": "128,256,512,1024,2048"}
# Tokens D took from outside (vLLM's own counter, any connector): proof that D loaded rather than recomputed.
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
# vLLM's built-in NixlConnector's Prometheus histograms (D's side: the reads it posted).
BUILTIN_BYTES = "vllm:nixl_bytes_transferred_sum"
BUILTIN_SECONDS = "vllm:nixl_xfer_time_seconds_sum"
STATS_SETTLE_S = 10.0
FIGURE_KEYS = (
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_mean_ms",
    "e2e_p50_ms",
    "output_tok_s",
    "output_tokens",
    "wall_s",
    "first_chunk_tokens_mean",
    "ttft_by_length_ms",
    "e2e_by_length_ms",
    "kv_bytes",
    "kv_seconds",
    "gbps",
)


@dataclasses.dataclass(frozen=True)
class Workload:
    """The seeded prompt set every configuration runs (and a separate warm-up set)."""

    lengths: tuple[int, ...]
    prompts: tuple[tuple[int, ...], ...]
    warmup: tuple[tuple[int, ...], ...]
    max_tokens: int
    concurrency: int
    timeout_s: float

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(lengths: Sequence[int], repeats: int, seed: int, max_tokens: int, concurrency: int, timeout_s: float) -> Workload:
    """`repeats` rounds over `lengths`; every prompt distinct, so no prefix-cache hit on any server."""
    order = [n for _ in range(repeats) for n in lengths]
    prompts = tuple(tuple(p) for p in make_prompts(order, seed=seed))
    warmup = tuple(tuple(p) for p in make_prompts(list(lengths), seed=seed + 1_000_003))
    return Workload(tuple(lengths), prompts, warmup, max_tokens, concurrency, timeout_s)


def cpu_figure(cpu_s: float, workload: Workload) -> dict[str, float]:
    """The servers' CPU time (user + system, whole process groups) per measured request, in ms."""
    return {"cpu_ms_per_request": round(cpu_s * 1000 / len(workload.prompts), 1)}


def failed_entry(description: str, error: str, notes: Sequence[str] = (), **extra: Any) -> dict[str, Any]:
    """A configuration without figures (every figure None): it failed to start, errored or mismatched."""
    return {
        "ok": False,
        "error": error,
        "description": description,
        "notes": list(notes),
        **{k: None for k in FIGURE_KEYS},
        **extra,
    }


def run_colocated(settings: ServerSettings, workload: Workload) -> tuple[dict[str, Any], list[tuple[int, ...]] | None]:
    """The reference: one plain server; its outputs are what every PD configuration must reproduce."""
    desc = "one vLLM server, no connector (reference outputs)"
    lengths = [len(p) for p in workload.prompts]
    try:
        with colocated_server(settings) as server:
            run_load(server.url, workload.warmup, workload.max_tokens, 1, workload.timeout_s)
            cpu0 = server.group_cpu_seconds()
            results, wall = run_load(server.url, workload.prompts, workload.max_tokens, workload.concurrency, workload.timeout_s)
            cpu = cpu_figure(server.group_cpu_seconds() - cpu0, workload)
    except RuntimeError as e:
        return failed_entry(desc, f"colocated server: {e}"), None
    figures, error, details = evaluate(results, wall, None, lengths)
    if figures is None:
        return failed_entry(desc, error or "", **details), None
    reference = [r.output_ids for r in results if isinstance(r, Sample)]
    if len(set(reference)) < max(2, len(reference) // 2) and len(reference) > 2:
        logger.warning(
            "colocated outputs are near-constant (%d distinct of %d): a broken transfer could go unseen",
            len(set(reference)),
            len(reference),
        )
    entry = {"ok": True, "error": None, "description": desc, "notes": [], **details, **figures, **kv_figures(None, None), **cpu}
    return entry, reference


def kv_counters(cfg: PdConfig, d: VllmServer) -> dict[str, float | None]:
    """D's counters: KV bytes and transfer seconds (ours: side channel; built-in: /metrics), external tokens."""
    out: dict[str, float | None] = {"external_tokens": metric(d.url, EXTERNAL_HITS, missing_ok=True)}
    if cfg.kv_source == "connector":
        s = stats(d)
        out.update(bytes=s.recv_bytes, seconds=s.recv_seconds, transfers=s.recv_transfers, failures=s.recv_failures)
    elif cfg.kv_source == "metrics":  # ours, any release: the kvc:* counters on /metrics (no side-channel query)
        out.update(
            bytes=metric(d.url, "kvc:recv_bytes_total"),
            seconds=metric(d.url, "kvc:transfer_seconds_sum"),
            transfers=metric(d.url, "kvc:recv_transfers_total"),
            failures=metric(d.url, "kvc:recv_failures_total"),
        )
    else:
        out.update(bytes=metric(d.url, BUILTIN_BYTES, missing_ok=True), seconds=metric(d.url, BUILTIN_SECONDS, missing_ok=True))
    return out


def settled_counters(
    cfg: PdConfig, d: VllmServer, expected_tokens: float, before: dict[str, float | None]
) -> dict[str, float | None]:
    """Counters after the run; vLLM publishes connector stats with the next engine step, so wait briefly."""
    deadline = time.monotonic() + STATS_SETTLE_S
    while True:
        after = kv_counters(cfg, d)
        done = (after["external_tokens"] or 0) - (before["external_tokens"] or 0) >= expected_tokens
        if cfg.kv_source == "builtin":
            done = done and (after["bytes"] or 0) > (before["bytes"] or 0)
        if done or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def kv_check(
    cfg: PdConfig, before: dict[str, float | None], after: dict[str, float | None], workload: Workload
) -> tuple[dict[str, Any], str | None]:
    """KV figures and whether D really loaded the prompts (external tokens, and our transfer count)."""
    delta = {k: None if before[k] is None or after[k] is None else after[k] - before[k] for k in after}
    n = len(workload.prompts)
    error = None
    # D recomputes the last prompt token itself; a block-granular connector may also leave a partial block.
    if (delta["external_tokens"] or 0) < workload.prompt_tokens // 2:
        error = (
            f"D took {delta['external_tokens']:.0f} of {workload.prompt_tokens} prompt tokens from outside: "
            "it recomputed instead of loading the KV"
        )
    elif cfg.kv_source in ("connector", "metrics") and (delta["transfers"] != n or delta["failures"]):
        error = f"D loaded {delta['transfers']} of {n} prompts ({delta['failures']} failed loads)"
    kv_bytes = None if not delta["bytes"] else int(delta["bytes"])
    figures = kv_figures(kv_bytes, delta["seconds"] or None)
    figures["kv_loaded_tokens"] = int(delta["external_tokens"] or 0)
    return figures, error


def start_pair(stack: contextlib.ExitStack, cfg: PdConfig, settings: ServerSettings) -> tuple[VllmServer, VllmServer, ProxyProcess]:
    """P and D started together (each stopped by the stack, whatever happens), then the proxy."""
    p, d = cfg.build(settings)
    stack.enter_context(running(p, d))
    return p, d, start_proxy(stack, cfg, p, d)


def start_proxy(stack: contextlib.ExitStack, cfg: PdConfig, p: VllmServer, d: VllmServer) -> ProxyProcess:
    """The proxy in front of a ready P and D (one up before them would find them unhealthy)."""
    proxy = ProxyProcess([p.url], [d.url], extra_args=cfg.proxy_args)
    proxy.start()
    stack.callback(proxy.stop)
    proxy.wait_ready()
    return proxy


def run_pd(cfg: PdConfig, settings: ServerSettings, workload: Workload, reference: Sequence[tuple[int, ...]]) -> dict[str, Any]:
    """One configuration: start P, D and the proxy, warm up, run the prompt set through the proxy, stop all."""
    lengths = [len(p) for p in workload.prompts]
    t0 = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            p, d, proxy = start_pair(stack, cfg, settings)
            logger.info("%s: servers up in %.0f s", cfg.name, time.monotonic() - t0)
            warm, _ = run_load(proxy.url, workload.warmup, workload.max_tokens, 1, workload.timeout_s)
            bad = [str(r) for r in warm if isinstance(r, RequestFailed)]
            if bad:
                return failed_entry(cfg.description, f"warm-up request failed: {bad[0]} (D log {d.log_path})", cfg.notes)
            before = kv_counters(cfg, d)
            cpu0 = p.group_cpu_seconds() + d.group_cpu_seconds()
            results, wall = run_load(proxy.url, workload.prompts, workload.max_tokens, workload.concurrency, workload.timeout_s)
            cpu_s = p.group_cpu_seconds() + d.group_cpu_seconds() - cpu0
            after = settled_counters(cfg, d, workload.prompt_tokens // 2, before)
    except RuntimeError as e:
        return failed_entry(cfg.description, f"start-up or stats failed: {e}", cfg.notes)
    figures, error, details = evaluate(results, wall, reference, lengths)
    kv, kv_error = kv_check(cfg, before, after, workload)
    error = error or kv_error
    if figures is None or error:
        return failed_entry(cfg.description, error or "", cfg.notes, **details)
    return {
        "ok": True,
        "error": None,
        "description": cfg.description,
        "notes": list(cfg.notes),
        **details,
        **figures,
        **kv,
        **cpu_figure(cpu_s, workload),
    }


@dataclasses.dataclass
class _Live:
    """One configuration's running servers in an interleaved run, and what its requests measured."""

    url: str  # where requests go: the proxy (colocated: the server)
    servers: tuple[VllmServer, ...]
    cfg: PdConfig | None = None  # None: colocated
    results: list[Sample | RequestFailed] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    before: dict[str, float | None] = dataclasses.field(default_factory=dict)


def _entry(live: _Live, workload: Workload, reference: Sequence[tuple[int, ...]] | None) -> dict[str, Any]:
    """An interleaved configuration's figures, checked like a sequential run's."""
    lengths = [len(p) for p in workload.prompts]
    desc = live.cfg.description if live.cfg is not None else "one vLLM server, no connector (reference outputs)"
    notes = live.cfg.notes if live.cfg is not None else ()
    figures, error, details = evaluate(live.results, live.wall_s, reference, lengths)
    kv: dict[str, Any] = kv_figures(None, None)
    if live.cfg is not None:
        d = live.servers[1]
        try:
            after = settled_counters(live.cfg, d, workload.prompt_tokens // 2, live.before)
        except RuntimeError as e:
            return failed_entry(desc, f"stats failed: {e}", notes, **details)
        kv, kv_error = kv_check(live.cfg, live.before, after, workload)
        error = error or kv_error
    if figures is None or error:
        return failed_entry(desc, error or "", notes, **details)
    return {
        "ok": True,
        "error": None,
        "description": desc,
        "notes": list(notes),
        **details,
        **figures,
        **kv,
        **cpu_figure(live.cpu_s, workload),
    }


def run_interleaved(names: Sequence[str], settings: ServerSettings, workload: Workload) -> dict[str, dict[str, Any]]:
    """Every configuration's servers up at once; each prompt goes to each configuration in turn (the
    order rotating from prompt to prompt), one request in flight, so that the machine's drift over
    the run reaches every configuration alike. Between its requests a configuration is idle."""
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        # every server starts at once (a start here is mostly one core importing Python), then each
        # configuration waits for its own: one that fails to start is reported, the others run
        colocated = colocated_server(settings)
        pairs = {name: CONFIGS[name].build(settings) for name in names}
        servers = [colocated, *(s for pair in pairs.values() for s in pair)]
        stack.callback(stop_all, servers)
        for server in servers:
            server.start()
        colocated.wait_ready()
        lives = {COLOCATED: _Live(colocated.url, (colocated,))}
        for name, (p, d) in pairs.items():
            try:
                p.wait_ready()
                d.wait_ready()
                proxy = start_proxy(stack, CONFIGS[name], p, d)
            except RuntimeError as e:
                results[name] = failed_entry(CONFIGS[name].description, f"start-up failed: {e}", CONFIGS[name].notes)
                continue
            lives[name] = _Live(proxy.url, (p, d), CONFIGS[name])
        for live in lives.values():  # a warm-up failure shows in the measured requests
            run_load(live.url, workload.warmup, workload.max_tokens, 1, workload.timeout_s)
            if live.cfg is not None:
                live.before = kv_counters(live.cfg, live.servers[1])
        order = list(lives)
        for i, prompt in enumerate(workload.prompts):
            for name in order[i % len(order) :] + order[: i % len(order)]:
                live = lives[name]
                cpu0 = sum(s.group_cpu_seconds() for s in live.servers)
                got, wall = run_load(live.url, [prompt], workload.max_tokens, 1, workload.timeout_s)
                live.cpu_s += sum(s.group_cpu_seconds() for s in live.servers) - cpu0
                live.wall_s += wall
                live.results += got
            print(f"prompt {i + 1} of {len(workload.prompts)} done", flush=True)
        colocated_entry = _entry(lives[COLOCATED], workload, None)
        reference = [r.output_ids for r in lives[COLOCATED].results if isinstance(r, Sample)] if colocated_entry["ok"] else None
        results[COLOCATED] = colocated_entry
        for name, live in lives.items():
            if name == COLOCATED:
                continue
            if reference is None:
                results[name] = failed_entry(
                    live.cfg.description if live.cfg else "", "no colocated reference to check outputs against"
                )
            else:
                results[name] = _entry(live, workload, reference)
    return {name: results[name] for name in [COLOCATED, *names] if name in results}


def parse_lengths(text: str) -> list[int]:
    lengths = [int(x) for x in text.split(",") if x.strip()]
    if not lengths or min(lengths) < 2:
        raise ValueError(f"--lengths needs token counts >= 2, got {text!r}")
    return lengths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated, from: {', '.join(CONFIGS)} (colocated always runs)"
    )
    ap.add_argument(
        "--model-size",
        choices=MODEL_SIZES,
        default="tiny",
        help="random-weight Llama built locally: tiny (2 MB), small (~88 MB), medium (~346 MB)",
    )
    ap.add_argument(
        "--lengths", default=None, help="prompt lengths in tokens (default: 128..1024 for tiny, 128..2048 for small/medium)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="distinct prompts per length")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (greedy, ignore_eos)")
    ap.add_argument("--seed", type=int, default=0, help="prompt set seed")
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object keyed by configuration, last line")
    ap.add_argument("--plot", metavar="FILE.png", help="draw mean TTFT against prompt length per configuration")
    ap.add_argument("--verbose", action="store_true", help="log server start-up and stops")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="start every configuration at once and send each prompt to each in turn (concurrency 1): "
        "before/after comparisons on a noisy host (a configuration that spins while idle slows the others)",
    )
    ap.add_argument(
        "--pin",
        metavar="P_CPUS:D_CPUS",
        help="run every P on P_CPUS and every D (and the colocated server) on D_CPUS (taskset -c lists, "
        "e.g. 0:1): every configuration gets the same cores, whatever the scheduler would have done",
    )
    args = ap.parse_args(argv)
    if args.pin is not None:
        parts = args.pin.split(":")
        if len(parts) != 2 or not all(parts):
            ap.error(f"--pin takes P_CPUS:D_CPUS (e.g. 0:1), got {args.pin!r}")
        args.pin = (parts[0], parts[1])
    try:
        args.config_names = parse_configs(args.configs)
        args.length_list = parse_lengths(args.lengths or DEFAULT_LENGTHS[args.model_size])
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 1 or args.concurrency < 1 or args.max_tokens < 1:
        ap.error("--repeats, --concurrency and --max-tokens must be >= 1")
    if args.interleave and args.concurrency != 1:
        ap.error("--interleave sends one request at a time (--concurrency 1)")
    return args


def plot(results: dict[str, dict[str, Any]], path: str, title: str, note: str) -> None:
    from benchmarks.plots import line_plot

    series = {}
    for name, r in results.items():
        by_len = r.get("ttft_by_length_ms") or {}
        if by_len:
            xs = sorted(int(k) for k in by_len)
            series[name] = (xs, [by_len[str(x)] for x in xs])
    if not series:
        print(f"no configuration has figures: {path} not drawn")
        return
    out = line_plot(
        series,
        path,
        title=title,
        xlabel="prompt length (tokens)",
        ylabel="mean TTFT (ms, log scale)",
        logx=True,
        logy=True,
        note=note,
    )
    print(f"plot: {out}")


def run(args: argparse.Namespace, host: str) -> dict[str, dict[str, Any]]:
    lengths = args.length_list
    model = build_tiny_model(variant=args.model_size)
    settings = settings_for(model, args.model_size, max(lengths), args.max_tokens, args.concurrency)
    if args.pin:
        settings = dataclasses.replace(settings, p_cpus=args.pin[0], d_cpus=args.pin[1])
    workload = make_workload(lengths, args.repeats, args.seed, args.max_tokens, args.concurrency, args.request_timeout_s)
    print(f"bench_e2e {datetime.datetime.now().isoformat(timespec='seconds')} on {host}")
    print(
        f"model {args.model_size} ({weight_bytes(args.model_size) / 1e6:.0f} MB float32 weights, "
        f"{kv_bytes_per_token(args.model_size) // 1024} KiB KV/token, {max_positions(args.model_size)} positions), "
        f"max_model_len {settings.max_model_len}, KV cache {settings.kv_cache_bytes >> 20} MiB per server"
    )
    print(
        f"prompts: lengths {lengths} x {args.repeats} (seed {args.seed}), {args.max_tokens} output tokens, "
        f"concurrency {args.concurrency}; configs: colocated, {', '.join(args.config_names)}"
        + (f"; pinned: every P on cores {args.pin[0]}, every D and colocated on {args.pin[1]}" if args.pin else ""),
        flush=True,
    )
    if args.interleave:
        results = run_interleaved(args.config_names, settings, workload)
        add_ratios(results)
        return results
    results: dict[str, dict[str, Any]] = {}
    results[COLOCATED], reference = run_colocated(settings, workload)
    print(f"{COLOCATED}: {'ok' if results[COLOCATED]['ok'] else results[COLOCATED]['error']}", flush=True)
    for name in args.config_names:
        cfg = CONFIGS[name]
        if reference is None:
            results[name] = failed_entry(cfg.description, "no colocated reference to check outputs against", cfg.notes)
            continue
        results[name] = run_pd(cfg, settings, workload, reference)
        print(f"{name}: {'ok' if results[name]['ok'] else results[name]['error']}", flush=True)
    add_ratios(results)
    return results


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print("\nTTFT and end-to-end latency in ms (streamed through the proxy; colocated: direct)")
    print(figures_table(results))
    builtin = builtin_baseline(results)
    if builtin is not None or COLOCATED in results:
        over = builtin or "builtin-nixl (not in this run)"
        print(f"\nratios: /bi = over {over}, /co = over colocated (TTFT, e2e: lower is better)")
        print(ratios_table(results))
    print("\nmean TTFT (ms) by prompt length")
    print(by_length_table(results))
    for name, r in results.items():
        for note in r.get("notes") or ():
            print(f"note ({name}): {note}")
        if not r["ok"]:
            print(f"FAILED {name}: {r['error']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    host = machine()  # load average at the start
    try:
        results = run(args, host)
    except ValueError as e:
        print(f"bench_e2e: {e}", file=sys.stderr)
        return 2
    report(results, args)
    if args.plot:
        day = datetime.date.today().isoformat()
        plot(
            results, args.plot, f"TTFT vs prompt length, {args.model_size} model, concurrency {args.concurrency}", f"{day}; {host}"
        )
    if args.json:
        print(json.dumps(results), flush=True)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
