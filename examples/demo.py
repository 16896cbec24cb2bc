#!/usr/bin/env python3
"""`make demo`: a 1P1D disaggregated run on the locally built tiny model, through the example proxy,
checked token for token against a colocated server, with the KV transfer figures of each request."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import httpx

from kvc_testing.cluster import (
    ENTRY_POINT_FORM,
    MODULE_FORM,
    MOONCAKE_ENTRY_POINT_FORM,
    MOONCAKE_MODULE_FORM,
    ProxyProcess,
    generate,
    make_prompts,
    output_ids,
    pd_server,
    stats,
    wait_until,
)
from kvc_testing.procs import VllmServer, running
from kvc_testing.tiny_model import build_tiny_model

LENGTHS = [1, 17, 31, 32, 33, 64, 100, 129, 250, 333, 400, 500]
MAX_MODEL_LEN = 512
# P uses vLLM's module-path form, D our entry-point name: the demo shows both loading forms.
FORMS = {
    "nixl": (MODULE_FORM, ENTRY_POINT_FORM),
    "mooncake": (MOONCAKE_MODULE_FORM, MOONCAKE_ENTRY_POINT_FORM),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--transport", choices=["nixl", "mooncake"], default="nixl")
    ap.add_argument(
        "--mode",
        choices=["pull", "push"],
        default=None,
        help="pull: D reads P's blocks; push: P writes into D's (default: pull for nixl, push for mooncake)",
    )
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--staging",
        choices=["auto", "on", "off", "fragmented"],
        default="auto",
        help="CPU staging through a bounded host pool (auto: only where device memory cannot be registered; "
        "fragmented: only transfers of many short runs, the rest directly)",
    )
    ap.add_argument("--pool-kib", type=int, default=128, help="staging pool size (with --staging on)")
    ap.add_argument("--verbose", action="store_true", help="log server start-up and stops")
    return ap.parse_args(argv)


def _row(n: int, ok: bool, text: str, d: dict[str, float], ms: float) -> str:
    gbps = d["bytes"] / d["seconds"] / 1e9 if d["seconds"] else 0.0
    return (
        f"{n:5d} {'match' if ok else 'MISMATCH':>8} {d['bytes'] / 1024:9.0f} {d['blocks']:6d} {d['descriptors']:5d} "
        f"{d['seconds'] * 1e3:8.2f} {gbps:6.2f} {ms:8.0f}  {text!r}"
    )


def run(args: argparse.Namespace) -> int:
    model = build_tiny_model()
    print(f"model: {model}")
    ref = VllmServer(model, max_model_len=MAX_MODEL_LEN, name="colocated")
    p_form, d_form = FORMS[args.transport]
    staging = {"staging": args.staging, "staging_pool_kib": args.pool_kib, "staging_chunk_kib": max(1, args.pool_kib // 4)}
    d_extra = {**staging, **({"mode": args.mode} if args.mode else {})}
    p = pd_server(model, "kv_producer", form=p_form, name="prefill", max_model_len=MAX_MODEL_LEN, extra_config=staging)
    d = pd_server(model, "kv_consumer", form=d_form, name="decode", max_model_len=MAX_MODEL_LEN, extra_config=d_extra)
    print(f"transport {args.transport}, mode {args.mode or 'default'}, staging {args.staging}: P loads {p_form}, D loads {d_form}")
    t0 = time.monotonic()
    with running(ref, p, d), ProxyProcess([p.url], [d.url]) as proxy, httpx.Client(timeout=120.0) as client:
        proxy.wait_ready()
        print(f"servers up in {time.monotonic() - t0:.0f} s: colocated {ref.url}, P {p.url}, D {d.url}, proxy {proxy.url}")
        print(f"{'toks':>5} {'result':>8} {'KiB':>9} {'blocks':>6} {'descs':>5} {'xfer ms':>8} {'GB/s':>6} {'e2e ms':>8}  D output")
        mismatches = 0
        totals = {"bytes": 0, "blocks": 0, "descriptors": 0, "seconds": 0.0}
        for n, prompt in zip(LENGTHS, make_prompts(LENGTHS, seed=42)):
            expected = generate(ref.url, prompt, args.max_tokens, client=client).json()["choices"][0]
            before = stats(d)
            t = time.monotonic()
            got = generate(proxy.url, prompt, args.max_tokens, client=client)
            ms = (time.monotonic() - t) * 1e3
            after = stats(d)
            delta = {
                "bytes": after.recv_bytes - before.recv_bytes,
                "blocks": after.recv_blocks - before.recv_blocks,
                "descriptors": after.recv_descriptors - before.recv_descriptors,
                "seconds": after.recv_seconds - before.recv_seconds,
            }
            for k in totals:
                totals[k] += delta[k]
            ok = output_ids(got) == expected["token_ids"]
            mismatches += not ok
            print(_row(n, ok, got.json()["choices"][0]["text"][:30], delta, ms))
        wait_until(lambda: stats(p).held_blocks == 0, 10, "P to free every block")
        ps = stats(p)
        gbps = totals["bytes"] / totals["seconds"] / 1e9 if totals["seconds"] else 0.0
        print(
            f"\n{len(LENGTHS) - mismatches}/{len(LENGTHS)} match the colocated run; KV moved: "
            f"{totals['bytes'] / 2**20:.2f} MiB in {totals['blocks']} blocks, {totals['descriptors']} descriptors, "
            f"{totals['seconds'] * 1e3:.1f} ms of transfer ({gbps:.2f} GB/s); P freed {ps.completed_sends} "
            f"requests' blocks, holds {ps.held_blocks}"
        )
        ds = stats(d)
        if ds.staging_pool_bytes:
            print(
                f"staging: pool {ds.staging_pool_bytes // 1024} KiB on each side, peak use on D "
                f"{ds.staging_peak_bytes // 1024} KiB, on P {ps.staging_peak_bytes // 1024} KiB; transfers "
                f"through it {ps.staged_transfers + ds.staged_transfers}, direct {ps.direct_transfers + ds.direct_transfers}"
            )
        if totals["bytes"] == 0 or ds.recv_failures:
            print(
                f"FAILED: D moved {totals['bytes']} bytes of KV ({ds.recv_failures} failed loads): "
                "the outputs above were not computed from P's KV"
            )
            return 1
        return 1 if mismatches else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
