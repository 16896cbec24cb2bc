#!/usr/bin/env python3
"""Does layer-wise push shorten time-to-first-token? Same run, same D, same prompt.

Starts one D and two Ps of our connector on the tiny model: P "on" writes each layer's blocks
to D as soon as the layer is computed (`layerwise: true`, the default), P "off" pushes the
whole request once it finished (`layerwise: false`). Requests go the transfer-id way, P and D
at once, as a Mooncake-style proxy sends them; the two Ps alternate. TTFT is the time from
dispatch to D's first streamed token. Prints a table, and with --json one JSON object last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import httpx

from benchmarks.e2e.client import stream_one
from benchmarks.e2e.stats import Sample
from kvc_testing.cluster import (
    ENTRY_POINT_FORM,
    MODULE_FORM,
    MOONCAKE_ENTRY_POINT_FORM,
    MOONCAKE_MODULE_FORM,
    make_prompts,
    pd_server,
    stats,
    transfer_id_params,
)
from kvc_testing.procs import VllmServer
from kvc_testing.tiny_model import build_tiny_model

FORMS = {"nixl": (MODULE_FORM, ENTRY_POINT_FORM), "mooncake": (MOONCAKE_MODULE_FORM, MOONCAKE_ENTRY_POINT_FORM)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", choices=sorted(FORMS), default="nixl")
    ap.add_argument("--length", type=int, default=500, help="prompt tokens (the demo's longest prompt: 500)")
    ap.add_argument("--repeats", type=int, default=20, help="requests per P")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--d-first-ms", type=float, default=0.0, help="send D this much before P (0: at once, as a proxy does)")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


async def _one_request(p: VllmServer, d: VllmServer, prompt: list[int], args: argparse.Namespace) -> Sample:
    """P and D at once (D first by --d-first-ms); TTFT counted from dispatch."""
    p_params, d_params = transfer_id_params(p)
    p_body = {"prompt": prompt, "temperature": 0, "max_tokens": 1, "kv_transfer_params": p_params}
    async with httpx.AsyncClient(timeout=120) as client:
        t0 = time.perf_counter()
        d_task = asyncio.create_task(stream_one(client, d.url, prompt, args.max_tokens, {"kv_transfer_params": d_params}, t0=t0))
        if args.d_first_ms:
            await asyncio.sleep(args.d_first_ms / 1e3)
        p_resp = await client.post(f"{p.url}/v1/completions", json=p_body)
        if p_resp.status_code != 200:
            d_task.cancel()
            raise RuntimeError(f"P answered {p_resp.status_code}: {p_resp.text[:300]}")
        return await d_task


def one_request(p: VllmServer, d: VllmServer, prompt: list[int], args: argparse.Namespace) -> tuple[float, list[int]]:
    sample = asyncio.run(_one_request(p, d, prompt, args))
    return sample.ttft_s, list(sample.output_ids)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = build_tiny_model()
    p_form, d_form = FORMS[args.transport]
    common = {"max_model_len": args.max_model_len}
    servers = {
        "on": pd_server(model, "kv_producer", form=p_form, name="P-layerwise", extra_config={"layerwise": True}, **common),
        "off": pd_server(model, "kv_producer", form=p_form, name="P-whole", extra_config={"layerwise": False}, **common),
    }
    d = pd_server(model, "kv_consumer", form=d_form, name="D", **common)
    prompt = make_prompts([args.length], seed=7)[0]
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    outputs: set[tuple[int, ...]] = set()
    with servers["on"], servers["off"], d:
        before = {k: stats(s) for k, s in servers.items()}
        for _name, p in servers.items():  # warm-up: handshakes, first-request costs
            outputs.add(tuple(one_request(p, d, prompt, args)[1]))
        for _ in range(args.repeats):
            for name, p in servers.items():
                t, ids = one_request(p, d, prompt, args)
                ttft[name].append(t)
                outputs.add(tuple(ids))
        after = {k: stats(s) for k, s in servers.items()}
    med = {k: statistics.median(v) * 1e3 for k, v in ttft.items()}
    result = {
        "transport": args.transport,
        "length": args.length,
        "repeats": args.repeats,
        "d_first_ms": args.d_first_ms,
        "ttft_p50_ms": med,
        "ttft_mean_ms": {k: statistics.fmean(v) * 1e3 for k, v in ttft.items()},
        "ratio_on_to_off": med["on"] / med["off"],
        "layerwise_pushes": {k: after[k].layerwise_pushes - before[k].layerwise_pushes for k in servers},
        "pushes": {k: after[k].pushes - before[k].pushes for k in servers},
        "outputs_identical": len(outputs) == 1,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    r = run(args)
    print(f"{args.transport}, {args.length}-token prompt, {args.repeats} requests per P, D sent {args.d_first_ms:g} ms before P")
    print(f"{'P':>4} {'TTFT p50 ms':>12} {'mean ms':>9} {'layer-wise':>11} {'pushes':>7}")
    for k in ("on", "off"):
        print(f"{k:>4} {r['ttft_p50_ms'][k]:12.1f} {r['ttft_mean_ms'][k]:9.1f} {r['layerwise_pushes'][k]:11d} {r['pushes'][k]:7d}")
    print(f"TTFT ratio layer-wise / whole (p50): {r['ratio_on_to_off']:.3f}; outputs identical: {r['outputs_identical']}")
    if args.json:
        print(json.dumps(r))
    return 0 if r["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
