"""Added latency of the example proxy: TTFT through it vs direct to a colocated server, 1-token prompts, one run.

Starts a colocated vLLM server, a NIXL P and D and examples/proxy.py on the tiny model, then times streamed
1-token-prompt completions (time to the first SSE event) three ways, interleaved:
  direct     the colocated server
  manual_pd  the client itself does what the proxy does (P request, then D streamed with P's kv_transfer_params)
  proxy      through examples/proxy.py
proxy/direct is the cost of disaggregation as a user sees it; proxy - manual_pd is the proxy's own overhead.

    python -m benchmarks.router.bench_proxy [--requests 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx

from kvc_testing.cluster import ENTRY_POINT_FORM, MODULE_FORM, ProxyProcess, pd_server
from kvc_testing.procs import VllmServer, running
from kvc_testing.tiny_model import build_tiny_model

PROMPT = [17]
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def ttft_stream(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    """Seconds from sending to the first SSE data event; the rest of the stream is read and dropped."""
    t0 = time.perf_counter()
    first: float | None = None
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: stream without data")
    return first


def manual_pd(client: httpx.Client, p_url: str, d_url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    p = client.post(f"{p_url}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
    p.raise_for_status()
    params = p.json().get("kv_transfer_params")
    return time.perf_counter() - t0 + ttft_stream(client, d_url, {**body, "kv_transfer_params": params})


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "min_ms": ordered[0] * 1e3,
    }


def run(requests: int, warmup: int) -> dict[str, Any]:
    model = build_tiny_model()
    ref = VllmServer(model, name="colocated")
    p = pd_server(model, "kv_producer", form=MODULE_FORM, name="P")
    d = pd_server(model, "kv_consumer", form=ENTRY_POINT_FORM, name="D")
    with running(ref, p, d), ProxyProcess([p.url], [d.url]) as proxy, httpx.Client(timeout=60) as client:
        proxy.wait_ready()
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        paths: dict[str, Callable[[], float]] = {
            "direct": lambda: ttft_stream(client, ref.url, body),
            "manual_pd": lambda: manual_pd(client, p.url, d.url, body),
            "proxy": lambda: ttft_stream(client, proxy.url, body),
        }
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for i in range(warmup + requests):
            for name, fn in paths.items():  # interleaved: the same machine noise for all three
                value = fn()
                if i >= warmup:
                    samples[name].append(value)
    result: dict[str, Any] = {name: summary(values) for name, values in samples.items()}
    med = {name: statistics.median(values) for name, values in samples.items()}
    result["requests"] = requests
    result["ratio_proxy_vs_direct"] = med["proxy"] / med["direct"]
    result["ratio_proxy_vs_manual_pd"] = med["proxy"] / med["manual_pd"]
    result["proxy_overhead_ms"] = (med["proxy"] - med["manual_pd"]) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    result = run(args.requests, args.warmup)
    if args.json:
        print(json.dumps(result))
        return
    print(f"TTFT, 1-token prompt, {args.requests} requests each (interleaved)")
    for name in ("direct", "manual_pd", "proxy"):
        s = result[name]
        print(f"  {name:10s} median {s['median_ms']:7.2f} ms  p90 {s['p90_ms']:7.2f} ms  min {s['min_ms']:7.2f} ms")
    print(f"  proxy / direct (colocated) = {result['ratio_proxy_vs_direct']:.2f}")
    print(
        f"  proxy / manual P-then-D    = {result['ratio_proxy_vs_manual_pd']:.2f}"
        f"  (proxy's own overhead {result['proxy_overhead_ms']:.2f} ms)"
    )


if __name__ == "__main__":
    main()
