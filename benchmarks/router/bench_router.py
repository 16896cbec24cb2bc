"""The proxy's routing decisions measured on one 2P2D fleet of real vLLM servers, each pair of runs in one run.

multiturn  conversations of several turns (each turn's prompt is the whole history: the last prompt, its
           output and new user tokens), prefix policy vs round robin on both roles: KV bytes D loaded per
           request, prompt tokens P and D computed (vLLM's prompt_tokens_by_source, local_compute), mean
           TTFT. A third arm adds conditional disaggregation to the prefix policy (--local-prefill-below
           --turn-local: a turn whose uncached part on the chosen D is shorter goes to D alone).
           Each arm gets its own conversations (same shapes), so none finds another's in a cache.
short      prompts shorter than --local-prefill-below: D alone vs always disaggregating, interleaved
           request by request; TTFT ratio.
seed       first token from prefill on vs off vs a colocated server, interleaved request by request,
           prompts of --lengths; TTFT ratios.
router-kv  (not in the default set) the multiturn workload through vllm-router (the pinned one, its own venv)
           in front of the same fleet, every P and D publishing vLLM's KV events (--kv-events-config):
           its kv_aware policy fed by P's publishers (--pd-kv-events; its PD mode subscribes to prefill
           servers only) against round robin, and kv_aware with its decode session affinity (a session
           header per conversation). Same figures as multiturn, plus D's prefix-cache hits (a turn on the
           D that holds its history), the BlockStored blocks P published (counted by a subscriber of our
           own), vllm-router's own KV-lookup counters, and its answer when told to subscribe to the
           decode servers' publishers.

  python -m benchmarks.router.bench_router [--scenarios multiturn,short,seed,router-kv] [--model-size tiny] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.e2e.configs import BLOCK_SIZE, settings_for
from kvc_testing.cluster import ENTRY_POINT_FORM, MODULE_FORM, ProxyProcess, kv_events_args, make_prompts, metric, pd_server, stats
from kvc_testing.procs import VllmServer, free_port
from kvc_testing.routers import RouterProcess, ensure_routers, vllm_router
from kvc_testing.tiny_model import build_tiny_model

SCENARIOS = ("multiturn", "short", "seed", "router-kv")
DEFAULT_SCENARIOS = ("multiturn", "short", "seed")
PROXY_ARGS = ("--health-interval-s", "1", "--health-timeout-s", "5", "--unhealthy-after", "5")
# vllm-router 0.1.17's --pd-kv-events: "Block size is 16" (its --help). vLLM's CPU attention takes only
# multiples of 32 ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"): the fleet stays at 32.
ROUTER_KV_BLOCK_SIZE = 16
VLLM_ROUTER_HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2")
# One of the headers vllm-router 0.1.17 reads a session from (x-session-id, session-id, ...).
SESSION_HEADER = "x-session-id"
Conversation = tuple[list[int], list[list[int]]]


def stream_ttft(
    client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[float, list[int]]:
    """Seconds to the first SSE event that carries a token, and the output token ids."""
    t0 = time.perf_counter()
    first: float | None = None
    out: list[int] = []
    body = {**body, "stream": True, "return_token_ids": True}
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            for choice in event.get("choices") or []:
                if choice.get("token_ids"):
                    out += choice["token_ids"]
                    if first is None:
                        first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: stream without a token")
    return first, out


def labelled(url: str, sample: str) -> float:
    """One labelled sample of a /metrics page (the name with its labels, as the page spells it)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"{url}/metrics has no {sample}")


def tokens_by_source(url: str, source: str) -> float:
    """A vLLM server's prompt tokens of one source (vllm:prompt_tokens_by_source: local_compute,
    local_cache_hit, external_kv_transfer)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:prompt_tokens_by_source":
            return sum(s.value for s in family.samples if s.name.endswith("_total") and s.labels.get("source") == source)
    raise RuntimeError(f"{url}/metrics has no vllm:prompt_tokens_by_source")


def computed_tokens(url: str) -> float:
    """Prompt tokens a vLLM server computed itself (not from its prefix cache, not loaded from a peer)."""
    return tokens_by_source(url, "local_compute")


def mean_ms(samples: Sequence[float]) -> float:
    return statistics.fmean(samples) * 1e3


class Fleet:
    """P and D servers (2 and 2 by default) on one model, and a colocated server where asked; proxies in
    front of them, one per configuration. kv_events: every P and D publishes vLLM's KV events on a port
    of its own (`events`: URL -> port)."""

    def __init__(
        self,
        variant: str,
        longest: int,
        max_tokens: int,
        n_prefill: int = 2,
        n_decode: int = 2,
        *,
        colocated: bool = True,
        kv_events: bool = False,
    ) -> None:
        model = build_tiny_model(variant=variant)
        settings = settings_for(model, variant, longest, max_tokens, concurrency=8)
        kw = settings.server_kwargs()
        self.events: dict[str, int] = {}
        self.prefill = [self._pd(model, "kv_producer", f"P{i}", kv_events, kw) for i in range(1, n_prefill + 1)]
        self.decode = [self._pd(model, "kv_consumer", f"D{i}", kv_events, kw) for i in range(1, n_decode + 1)]
        self.colocated = VllmServer(model, name="colocated", **kw) if colocated else None

    def _pd(self, model: Path, role: str, name: str, kv_events: bool, kw: dict[str, Any]) -> VllmServer:
        form = MODULE_FORM if role == "kv_producer" else ENTRY_POINT_FORM
        port = free_port() if kv_events else None
        extra = kv_events_args(port, f"kv-{name}") if port is not None else []
        server = pd_server(model, role, form=form, name=name, extra_args=extra, **kw)
        if port is not None:
            self.events[server.url] = port
        return server

    def servers(self) -> list[VllmServer]:
        return [*self.prefill, *self.decode, *([self.colocated] if self.colocated else [])]

    def urls(self) -> tuple[list[str], list[str]]:
        """The P servers' URLs and the D servers'."""
        return [p.url for p in self.prefill], [d.url for d in self.decode]

    def reference(self) -> VllmServer:
        if self.colocated is None:
            raise RuntimeError("this fleet has no colocated server (the seed scenario needs one)")
        return self.colocated

    def proxy(self, *args: str) -> ProxyProcess:
        return ProxyProcess([p.url for p in self.prefill], [d.url for d in self.decode], extra_args=[*PROXY_ARGS, *args])

    def counters(self) -> dict[str, float]:
        """P's prompt tokens, P's and D's computed prompt tokens, D's prefix-cache hits, loaded KV bytes
        and loads, each D's requests (cumulative)."""
        return {
            "p_prompt_tokens": sum(metric(p.url, "vllm:prompt_tokens_total") for p in self.prefill),
            "p_computed_tokens": sum(computed_tokens(p.url) for p in self.prefill),
            "d_computed_tokens": sum(computed_tokens(d.url) for d in self.decode),
            "d_cache_hit_tokens": sum(tokens_by_source(d.url, "local_cache_hit") for d in self.decode),
            "d_kv_bytes": float(sum(stats(d).recv_bytes for d in self.decode)),
            "d_loads": float(sum(stats(d).recv_transfers for d in self.decode)),
            **{f"requests_{d.name}": metric(d.url, "vllm:request_success_total") for d in self.decode},
        }

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """counters() now less `before`, once the last loads' counters are in."""
        time.sleep(1.0)
        after = self.counters()
        return {k: after[k] - before[k] for k in after}


def conversations(n: int, turns: int, context: int, turn_tokens: int, seed: int) -> list[Conversation]:
    """Each conversation: its opening context and the user tokens of each turn."""
    rng = random.Random(seed)
    out = []
    for c in range(n):
        opening = make_prompts([context], seed=seed * 1000 + c)[0]
        out.append((opening, [[rng.randrange(4, 1024) for _ in range(turn_tokens)] for _ in range(turns)]))
    return out


def converse_all(
    url: str, convs: list[Conversation], max_tokens: int, session_header: str | None = None, model: str | None = None
) -> list[float]:
    """Every conversation turn by turn (4 at a time), each turn's prompt the whole history; the TTFTs.
    session_header: conversation i sends it with the value conv-i; model: the body's "model"."""
    ttfts: list[float] = []
    with httpx.Client(timeout=300) as client:

        def converse(i: int) -> list[float]:
            opening, turns = convs[i]
            headers = {session_header: f"conv-{i}"} if session_header else None
            history, times = list(opening), []
            for user in turns:
                history += user
                body = {"prompt": history, "max_tokens": max_tokens, "temperature": 0, **({"model": model} if model else {})}
                ttft, out = stream_ttft(client, url, body, headers)
                times.append(ttft)
                history += out
            return times

        with ThreadPoolExecutor(4) as pool:
            for times in pool.map(converse, range(len(convs))):
                ttfts += times
    return ttfts


def arm_figures(policy: str, delta: dict[str, float], ttfts: Sequence[float]) -> dict[str, Any]:
    requests = len(ttfts)
    return {
        "policy": policy,
        "requests": requests,
        "kv_bytes_per_request": delta["d_kv_bytes"] / requests,
        "p_prompt_tokens": delta["p_prompt_tokens"],
        "p_computed_tokens": delta["p_computed_tokens"],
        "d_computed_tokens": delta["d_computed_tokens"],
        "d_cache_hit_tokens": delta["d_cache_hit_tokens"],
        "d_loads": delta["d_loads"],
        "d_requests": {k.removeprefix("requests_"): v for k, v in delta.items() if k.startswith("requests_")},
        "ttft_mean_ms": mean_ms(ttfts),
    }


def run_multiturn(fleet: Fleet, policy: str, convs: list[Conversation], max_tokens: int, *extra: str) -> dict[str, Any]:
    before = fleet.counters()
    args = ("--prefill-policy", policy, "--decode-policy", policy, *extra)
    with fleet.proxy(*args) as proxy:
        proxy.wait_ready()
        ttfts = converse_all(proxy.url, convs, max_tokens)
        local = labelled(proxy.url, 'kvc_proxy_decode_only_total{mode="local"}') if extra else 0.0
    return {**arm_figures(" ".join((policy, *extra)), fleet.since(before), ttfts), "local_prefills": local}


def _over(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return a[key] / b[key] if b[key] else None


def versus(arm: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """An arm's figures over the baseline arm's (None where the baseline's is 0)."""
    both = base["p_computed_tokens"] + base["d_computed_tokens"]
    return {
        "kv_bytes": _over(arm, base, "kv_bytes_per_request"),
        "p_computed_tokens": _over(arm, base, "p_computed_tokens"),
        "p_and_d_computed_tokens": (arm["p_computed_tokens"] + arm["d_computed_tokens"]) / both if both else None,
        "ttft": arm["ttft_mean_ms"] / base["ttft_mean_ms"],
    }


def multiturn(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    def convs(seed: int) -> list[Conversation]:
        return conversations(args.conversations, args.turns, args.context, args.turn_tokens, seed)

    arms = {
        "round_robin": run_multiturn(fleet, "round_robin", convs(1), 8),
        "prefix": run_multiturn(fleet, "prefix", convs(2), 8),
        "prefix_local": run_multiturn(fleet, "prefix", convs(3), 8, "--local-prefill-below", str(args.turn_local)),
    }
    out: dict[str, Any] = {**arms, "turn_local": args.turn_local}
    for name in ("prefix", "prefix_local"):
        out[name]["vs_round_robin"] = versus(arms[name], arms["round_robin"])
    return out


def router_kv_arms(fleet: Fleet) -> dict[str, list[str]]:
    """vllm-router's flags per arm (after --vllm-pd-disaggregation --kv-connector nixl and the workers)."""
    events = [f"--pd-kv-events={p.url}=tcp://127.0.0.1:{fleet.events[p.url]}" for p in fleet.prefill]
    kv_aware = ["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware", *events]
    return {
        "round_robin": ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"],
        "kv_aware": kv_aware,
        "kv_aware_affinity": [*kv_aware, "--kv-aware-session-affinity-ttl-secs", "600"],
    }


def router_metrics(router: RouterProcess) -> dict[str, float]:
    """vllm-router's own Prometheus samples about KV events and policy decisions (name with labels -> value)."""
    text = httpx.get(f"http://127.0.0.1:{router.prometheus_port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "quantile" in line or "_seconds" in line:
            continue
        if any(w in line for w in ("kv", "policy_decision", "prefix", "affinity", "sticky")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class StoredBlocks:
    """A SUB socket on each of some vLLM KV-event publishers (name -> port), counting the blocks each
    reports stored (BlockStored): what a subscriber could have indexed."""

    def __init__(self, ports: dict[str, int]) -> None:
        self.blocks = dict.fromkeys(ports, 0)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._count, args=item, daemon=True) for item in ports.items()]
        for thread in self._threads:
            thread.start()

    def _count(self, name: str, port: int) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            while not self._stop.is_set():
                if sock.poll(100):
                    _ts, events, *_ = msgspec.msgpack.decode(sock.recv_multipart()[-1])  # [ts, events, dp rank]
                    self.blocks[name] += sum(len(e["block_hashes"]) for e in events if e.get("type") == "BlockStored")
        except Exception as e:  # noqa: BLE001 - raised by close()
            self.errors.append(f"{name}: {e!r}")
        finally:
            sock.close(linger=0)
            ctx.term()

    def close(self) -> dict[str, int]:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        if self.errors:
            raise RuntimeError(f"counting KV events failed: {self.errors}")
        return self.blocks


def run_router_arm(
    fleet: Fleet, bin_dir: Path, flags: Sequence[str], convs: list[Conversation], session_header: str | None = None
) -> dict[str, Any]:
    before = fleet.counters()
    router = vllm_router(bin_dir, *fleet.urls(), *flags, *VLLM_ROUTER_HEALTH)
    published = StoredBlocks({p.name: fleet.events[p.url] for p in fleet.prefill})
    try:
        with router:
            router.wait_ready(120)
            time.sleep(2.0)  # the ZMQ subscribers connect: a SUB socket misses what is published before
            # vllm-router's kv_aware falls back ("unverified_model") for a request that names no model.
            ttfts = converse_all(router.url, convs, 8, session_header, model=fleet.prefill[0].model)
            seen = router_metrics(router)
    finally:
        stored = published.close()
    figures = arm_figures("vllm-router " + " ".join(flags), fleet.since(before), ttfts)
    return {**figures, "session_header": session_header, "p_blocks_published": stored, "router_metrics": seen}


def decode_events_refusal(fleet: Fleet, bin_dir: Path) -> dict[str, Any]:
    """vllm-router in PD mode told to subscribe to the decode servers' publishers (kv_aware on both roles,
    --kv-event-source per D): the command and how it ends (it refuses at start-up, or it is accepted)."""
    sources = [f"--kv-event-source={d.url}=tcp://127.0.0.1:{fleet.events[d.url]}" for d in fleet.decode]
    flags = ["--policy", "kv_aware", "--kv-event-model", "tiny", "--kv-event-block-size", str(BLOCK_SIZE), *sources]
    router = vllm_router(bin_dir, *fleet.urls(), *flags, name="vllm-router-d-events")
    argv = [str(bin_dir / "vllm-router"), *router.cli_args()]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=router.env)
    except subprocess.TimeoutExpired:
        return {"command": argv, "refused": False, "output": "still running after 30 s: accepted"}
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return {"command": argv, "refused": proc.returncode != 0, "exit": proc.returncode, "output": lines[-1] if lines else ""}


def proxy_kv_events_flags(fleet: Fleet) -> list[str]:
    """Our proxy's prefix policy fed by every server's publisher (chunks of the servers' block size)."""
    flags = ["--prefix-chunk-tokens", str(BLOCK_SIZE)]
    for url, port in fleet.events.items():
        flags += ["--kv-events", f"{url}=tcp://127.0.0.1:{port}"]
    return flags


def router_kv(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    bin_dir = ensure_routers()
    arms = router_kv_arms(fleet)

    def convs(seed: int) -> list[Conversation]:
        return conversations(args.conversations, args.turns, args.context, args.turn_tokens, seed)

    out: dict[str, Any] = {
        "round_robin": run_router_arm(fleet, bin_dir, arms["round_robin"], convs(11)),
        "kv_aware": run_router_arm(fleet, bin_dir, arms["kv_aware"], convs(12)),
        "kv_aware_affinity": run_router_arm(fleet, bin_dir, arms["kv_aware_affinity"], convs(13), SESSION_HEADER),
        # Our proxy's prefix policy learning from the same servers' events (P's and D's), for comparison.
        "proxy_kv_events": run_multiturn(fleet, "prefix", convs(14), 8, *proxy_kv_events_flags(fleet)),
    }
    for name in ("kv_aware", "kv_aware_affinity", "proxy_kv_events"):
        out[name]["vs_round_robin"] = versus(out[name], out["round_robin"])
    out["decode_kv_events"] = decode_events_refusal(fleet, bin_dir)
    return {**out, "fleet_block_size": BLOCK_SIZE, "router_pd_event_block_size": ROUTER_KV_BLOCK_SIZE}


def interleaved(
    paths: dict[str, Callable[[dict[str, Any]], float]], bodies: dict[str, Sequence[dict[str, Any]]], warmup: int
) -> dict[str, list[float]]:
    """Request i of every path in turn (the same machine noise for all); the first `warmup` dropped. Each
    path has its own prompts (same lengths): a prompt another path sent first would be in P's and D's
    prefix caches."""
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(len(next(iter(bodies.values())))):
        for name, path in paths.items():
            value = path(bodies[name][i])
            if i >= warmup:
                samples[name].append(value)
    return samples


def ttft_ratios(samples: dict[str, list[float]], *pairs: tuple[str, str]) -> dict[str, Any]:
    """Each path's mean TTFT and the ratio of the means of each (path, baseline) pair."""
    mean = {name: statistics.fmean(v) for name, v in samples.items()}
    out: dict[str, Any] = {"requests": len(next(iter(samples.values())))}
    out |= {f"{name}_ttft_mean_ms": m * 1e3 for name, m in mean.items()}
    return out | {f"ratio_{a}_vs_{b}": mean[a] / mean[b] for a, b in pairs}


def bodies_of(lengths: Sequence[int], seed: int) -> list[dict[str, Any]]:
    return [{"prompt": p, "max_tokens": 8, "temperature": 0} for p in make_prompts(lengths, seed=seed)]


def short(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    limit = args.local_below
    rng = random.Random(3)
    lengths = [rng.randrange(4, limit) for _ in range(args.requests + args.warmup)]
    with (
        fleet.proxy("--local-prefill-below", str(limit)) as local,
        fleet.proxy() as pd,
        fleet.proxy("--no-first-token-from-prefill") as pd_unseeded,
        httpx.Client(timeout=120) as client,
    ):
        for proxy in (local, pd, pd_unseeded):
            proxy.wait_ready()
        samples = interleaved(
            {
                "local": lambda b: stream_ttft(client, local.url, b)[0],
                "pd": lambda b: stream_ttft(client, pd.url, b)[0],
                "pd_unseeded": lambda b: stream_ttft(client, pd_unseeded.url, b)[0],
            },
            {"local": bodies_of(lengths, 5), "pd": bodies_of(lengths, 6), "pd_unseeded": bodies_of(lengths, 7)},
            args.warmup,
        )
    return {"below_tokens": limit, **ttft_ratios(samples, ("local", "pd"), ("local", "pd_unseeded"))}


def seed(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(7)
    chosen = [rng.choice(lengths) for _ in range(args.requests + args.warmup)]
    mine = bodies_of(chosen, 9)  # the colocated server gets the seeded path's prompts: outputs compared
    outputs: dict[str, list[list[int]]] = {"seeded": [], "unseeded": [], "colocated": []}

    def path(name: str, url: str, client: httpx.Client) -> Callable[[dict[str, Any]], float]:
        def one(body: dict[str, Any]) -> float:
            ttft, out = stream_ttft(client, url, body)
            outputs[name].append(out)
            return ttft

        return one

    with (
        fleet.proxy() as seeded,
        fleet.proxy("--no-first-token-from-prefill") as unseeded,
        httpx.Client(timeout=300) as client,
    ):
        seeded.wait_ready()
        unseeded.wait_ready()
        samples = interleaved(
            {
                "seeded": path("seeded", seeded.url, client),
                "unseeded": path("unseeded", unseeded.url, client),
                "colocated": path("colocated", fleet.reference().url, client),
            },
            {"seeded": mine, "unseeded": bodies_of(chosen, 10), "colocated": mine},
            args.warmup,
        )
        seeded_count = labelled(seeded.url, 'kvc_proxy_first_token_total{result="seeded"}')
    return {
        "lengths": lengths,
        **ttft_ratios(samples, ("seeded", "unseeded"), ("seeded", "colocated"), ("unseeded", "colocated")),
        "outputs_equal": outputs["seeded"] == outputs["colocated"],
        "first_token_counted": seeded_count,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    longest = max([int(x) for x in args.lengths.split(",")] + [args.context + (args.turn_tokens + 8) * args.turns])
    kv_events = "router-kv" in names
    fleet = Fleet(
        args.model_size, longest, 8, args.prefill_servers, args.decode_servers, colocated="seed" in names, kv_events=kv_events
    )
    result: dict[str, Any] = {"model_size": args.model_size, "block_size": BLOCK_SIZE}
    with contextlib.ExitStack() as stack:
        for server in fleet.servers():
            server.start()
            stack.callback(server.stop)
        for server in fleet.servers():
            server.wait_ready()
        for name in names:
            result[name] = {"multiturn": multiturn, "short": short, "seed": seed, "router-kv": router_kv}[name](fleet, args)
    return result


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def print_router_kv(m: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"router-kv: vllm-router ({args.conversations} conversations x {args.turns} turns), kv_aware vs round_robin:")
    for arm in ("round_robin", "kv_aware", "kv_aware_affinity", "proxy_kv_events"):
        r = m[arm]
        print(
            f"  {arm:17s} KV bytes/request {r['kv_bytes_per_request']:10.0f}  computed tokens P {r['p_computed_tokens']:6.0f}"
            f" D {r['d_computed_tokens']:6.0f}  D cache hits {r['d_cache_hit_tokens']:6.0f}  requests per D "
            f"{'/'.join(f'{v:.0f}' for v in r['d_requests'].values())}  TTFT mean {r['ttft_mean_ms']:7.1f} ms"
        )
    for arm in ("kv_aware", "kv_aware_affinity", "proxy_kv_events"):
        v = m[arm]["vs_round_robin"]
        print(
            f"  {arm}/round_robin: KV bytes {_fmt(v['kv_bytes'])}, P computed {_fmt(v['p_computed_tokens'])}, "
            f"P+D computed {_fmt(v['p_and_d_computed_tokens'])}, TTFT {_fmt(v['ttft'])}"
        )
    for arm in ("kv_aware", "kv_aware_affinity"):
        seen = m[arm]["router_metrics"]
        lookups = {k.split('result="')[1].rstrip('"}'): v for k, v in seen.items() if "kv_placement_lookups" in k}
        print(
            f"  {arm}: P published {sum(m[arm]['p_blocks_published'].values())} blocks; vllm-router's KV lookups "
            f"{lookups}, prefix tokens credited {seen.get('vllm_router_pd_credited_prefix_tokens_total', 0):.0f}"
        )
    d = m["decode_kv_events"]
    print(f"  decode servers' KV events: {'refused' if d['refused'] else 'accepted'}: {d['output']}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS), help=f"of {', '.join(SCENARIOS)}")
    parser.add_argument("--model-size", default="tiny", choices=("tiny", "small", "medium"))
    parser.add_argument("--prefill-servers", type=int, default=2, help="P servers (seed alone: 1 is enough)")
    parser.add_argument("--decode-servers", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--context", type=int, default=192, help="multiturn: tokens of each conversation's opening")
    parser.add_argument("--turn-tokens", type=int, default=32, help="multiturn: user tokens added each turn")
    parser.add_argument("--local-below", type=int, default=64, help="short: the --local-prefill-below threshold")
    parser.add_argument(
        "--turn-local", type=int, default=64, help="multiturn, third arm: the --local-prefill-below threshold with prefix"
    )
    parser.add_argument("--lengths", default="128,256,512,1024", help="seed: prompt lengths")
    parser.add_argument("--requests", type=int, default=40, help="short and seed: requests per path")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    if "multiturn" in result:
        m = result["multiturn"]
        print(f"multiturn ({args.conversations} conversations x {args.turns} turns), prefix vs round_robin:")
        for arm in ("round_robin", "prefix", "prefix_local"):
            r = m[arm]
            print(
                f"  {arm:12s} KV bytes/request {r['kv_bytes_per_request']:10.0f}  computed tokens P {r['p_computed_tokens']:6.0f}"
                f" D {r['d_computed_tokens']:6.0f}  D alone {r['local_prefills']:4.0f}  TTFT mean {r['ttft_mean_ms']:7.1f} ms"
            )
        for arm in ("prefix", "prefix_local"):
            v = m[arm]["vs_round_robin"]
            print(
                f"  {arm}/round_robin: KV bytes {_fmt(v['kv_bytes'])}, P computed {_fmt(v['p_computed_tokens'])}, "
                f"P+D computed {v['p_and_d_computed_tokens']:.2f}, TTFT {v['ttft']:.2f}"
                + (f" (--local-prefill-below {m['turn_local']})" if arm == "prefix_local" else "")
            )
    if "router-kv" in result:
        print_router_kv(result["router-kv"], args)
    if "short" in result:
        s = result["short"]
        print(
            f"short prompts (< {s['below_tokens']} tokens): TTFT D alone {s['local_ttft_mean_ms']:.1f} ms, P/D "
            f"{s['pd_ttft_mean_ms']:.1f} ms (without first token from P {s['pd_unseeded_ttft_mean_ms']:.1f} ms); "
            f"ratios {s['ratio_local_vs_pd']:.2f}, {s['ratio_local_vs_pd_unseeded']:.2f}"
        )
    if "seed" in result:
        s = result["seed"]
        print(
            f"first token from prefill ({s['lengths']}): TTFT seeded {s['seeded_ttft_mean_ms']:.1f} ms, unseeded "
            f"{s['unseeded_ttft_mean_ms']:.1f} ms, colocated {s['colocated_ttft_mean_ms']:.1f} ms; seeded/unseeded "
            f"{s['ratio_seeded_vs_unseeded']:.2f}, seeded/colocated {s['ratio_seeded_vs_colocated']:.2f}; outputs equal "
            f"{s['outputs_equal']}"
        )


if __name__ == "__main__":
    main()
