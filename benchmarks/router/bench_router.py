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

  python -m benchmarks.router.bench_router [--scenarios multiturn,short,seed] [--model-size tiny] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.e2e.configs import settings_for
from kvc_testing.cluster import ENTRY_POINT_FORM, MODULE_FORM, ProxyProcess, make_prompts, metric, pd_server, stats
from kvc_testing.procs import VllmServer
from kvc_testing.tiny_model import build_tiny_model

SCENARIOS = ("multiturn", "short", "seed")
PROXY_ARGS = ("--health-interval-s", "1", "--health-timeout-s", "5", "--unhealthy-after", "5")


def stream_ttft(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, list[int]]:
    """Seconds to the first SSE event that carries a token, and the output token ids."""
    t0 = time.perf_counter()
    first: float | None = None
    out: list[int] = []
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as resp:
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


def computed_tokens(url: str) -> float:
    """Prompt tokens a vLLM server computed itself (not from its prefix cache, not loaded from a peer)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:prompt_tokens_by_source":
            return sum(s.value for s in family.samples if s.name.endswith("_total") and s.labels.get("source") == "local_compute")
    raise RuntimeError(f"{url}/metrics has no vllm:prompt_tokens_by_source")


def mean_ms(samples: Sequence[float]) -> float:
    return statistics.fmean(samples) * 1e3


class Fleet:
    """2 P, 2 D and a colocated server on one model; proxies in front of them, one per configuration."""

    def __init__(self, variant: str, longest: int, max_tokens: int, n_prefill: int = 2, n_decode: int = 2) -> None:
        model = build_tiny_model(variant=variant)
        settings = settings_for(model, variant, longest, max_tokens, concurrency=8)
        kw = settings.server_kwargs()
        self.prefill = [pd_server(model, "kv_producer", form=MODULE_FORM, name=f"P{i}", **kw) for i in range(1, n_prefill + 1)]
        self.decode = [pd_server(model, "kv_consumer", form=ENTRY_POINT_FORM, name=f"D{i}", **kw) for i in range(1, n_decode + 1)]
        self.colocated = VllmServer(model, name="colocated", **kw)

    def servers(self) -> list[VllmServer]:
        return [*self.prefill, *self.decode, self.colocated]

    def proxy(self, *args: str) -> ProxyProcess:
        return ProxyProcess([p.url for p in self.prefill], [d.url for d in self.decode], extra_args=[*PROXY_ARGS, *args])

    def counters(self) -> dict[str, float]:
        """P's prompt tokens, P's and D's computed prompt tokens, D's loaded KV bytes and loads (cumulative)."""
        return {
            "p_prompt_tokens": sum(metric(p.url, "vllm:prompt_tokens_total") for p in self.prefill),
            "p_computed_tokens": sum(computed_tokens(p.url) for p in self.prefill),
            "d_computed_tokens": sum(computed_tokens(d.url) for d in self.decode),
            "d_kv_bytes": float(sum(stats(d).recv_bytes for d in self.decode)),
            "d_loads": float(sum(stats(d).recv_transfers for d in self.decode)),
        }


def conversations(n: int, turns: int, context: int, turn_tokens: int, seed: int) -> list[tuple[list[int], list[list[int]]]]:
    """Each conversation: its opening context and the user tokens of each turn."""
    rng = random.Random(seed)
    out = []
    for c in range(n):
        opening = make_prompts([context], seed=seed * 1000 + c)[0]
        out.append((opening, [[rng.randrange(4, 1024) for _ in range(turn_tokens)] for _ in range(turns)]))
    return out


def run_multiturn(
    fleet: Fleet, policy: str, convs: list[tuple[list[int], list[list[int]]]], max_tokens: int, *extra: str
) -> dict[str, Any]:
    ttfts: list[float] = []
    before = fleet.counters()
    args = ("--prefill-policy", policy, "--decode-policy", policy, *extra)
    with fleet.proxy(*args) as proxy, httpx.Client(timeout=300) as client:
        proxy.wait_ready()

        def converse(conv: tuple[list[int], list[list[int]]]) -> list[float]:
            history, times = list(conv[0]), []
            for user in conv[1]:
                history += user
                ttft, out = stream_ttft(client, proxy.url, {"prompt": history, "max_tokens": max_tokens, "temperature": 0})
                times.append(ttft)
                history += out
            return times

        with ThreadPoolExecutor(4) as pool:
            for times in pool.map(converse, convs):
                ttfts += times
        local = labelled(proxy.url, 'kvc_proxy_decode_only_total{mode="local"}') if extra else 0.0
    time.sleep(1.0)  # the last loads' counters
    after = fleet.counters()
    delta = {k: after[k] - before[k] for k in after}
    requests = len(ttfts)
    return {
        "policy": " ".join((policy, *extra)),
        "requests": requests,
        "kv_bytes_per_request": delta["d_kv_bytes"] / requests,
        "p_prompt_tokens": delta["p_prompt_tokens"],
        "p_computed_tokens": delta["p_computed_tokens"],
        "d_computed_tokens": delta["d_computed_tokens"],
        "d_loads": delta["d_loads"],
        "local_prefills": local,
        "ttft_mean_ms": mean_ms(ttfts),
    }


def _over(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return a[key] / b[key] if b[key] else None


def multiturn(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    def convs(seed: int) -> list[tuple[list[int], list[list[int]]]]:
        return conversations(args.conversations, args.turns, args.context, args.turn_tokens, seed)

    arms = {
        "round_robin": run_multiturn(fleet, "round_robin", convs(1), 8),
        "prefix": run_multiturn(fleet, "prefix", convs(2), 8),
        "prefix_local": run_multiturn(fleet, "prefix", convs(3), 8, "--local-prefill-below", str(args.turn_local)),
    }
    rr = arms["round_robin"]
    out: dict[str, Any] = {**arms, "turn_local": args.turn_local}
    for name in ("prefix", "prefix_local"):
        px = arms[name]
        out[name]["vs_round_robin"] = {
            "kv_bytes": _over(px, rr, "kv_bytes_per_request"),
            "p_computed_tokens": _over(px, rr, "p_computed_tokens"),
            "p_and_d_computed_tokens": (px["p_computed_tokens"] + px["d_computed_tokens"])
            / (rr["p_computed_tokens"] + rr["d_computed_tokens"]),
            "ttft": px["ttft_mean_ms"] / rr["ttft_mean_ms"],
        }
    return out


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
                "colocated": path("colocated", fleet.colocated.url, client),
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
    fleet = Fleet(args.model_size, longest, 8, args.prefill_servers, args.decode_servers)
    result: dict[str, Any] = {"model_size": args.model_size}
    with contextlib.ExitStack() as stack:
        for server in fleet.servers():
            server.start()
            stack.callback(server.stop)
        for server in fleet.servers():
            server.wait_ready()
        for name in names:
            result[name] = {"multiturn": multiturn, "short": short, "seed": seed}[name](fleet, args)
    return result


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
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
