#!/usr/bin/env python3
"""Cost of the scheduler-side connector hooks, per request per step, at N running requests.

The scheduler calls our hooks on its own thread between forward passes: time spent there
delays every request. This drives SchedulerSide (the real class, no engine) through the
hooks vLLM calls for a step in which all N requests are scheduled: D side
(get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta, request_finished)
and P side with transfer ids (the same, with the layer-wise marking in build_connector_meta).
Prints microseconds per request per step; target: under 100. --json prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

from kv_connectors.config import parse_config
from kv_connectors.vllm.compat import RequestStatus
from kv_connectors.vllm.scheduler import SchedulerSide

BLOCK_SIZE = 32


def _blocks(ids: list[int]) -> Any:
    return SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None) for b in ids]])


def _requests(n: int, prompt_len: int, role: str, step: int) -> list[Any]:
    nblocks = -(-prompt_len // BLOCK_SIZE)
    reqs = []
    for i in range(n):
        rid = f"s{step}-r{i}"
        if role == "decode":
            params = {
                "do_remote_prefill": True,
                "remote_engine_id": "P",
                "remote_request_id": f"p-{rid}",
                "remote_host": "127.0.0.1",
                "remote_port": 5710,
                "remote_num_tokens": prompt_len,
                "remote_block_ids": list(range(i * nblocks, (i + 1) * nblocks)),
            }
        else:
            params = {"do_remote_decode": True, "transfer_id": f"kvc-{rid}"}
        reqs.append(
            SimpleNamespace(
                request_id=rid,
                kv_transfer_params=params,
                prompt_token_ids=list(range(prompt_len)),
                num_prompt_tokens=prompt_len,
                status=RequestStatus.FINISHED_LENGTH_CAPPED,
                block_ids=list(range(i * nblocks, (i + 1) * nblocks)),
            )
        )
        reqs[-1].blocks = _blocks(reqs[-1].block_ids)
    return reqs


def one_step(side: SchedulerSide, reqs: list[Any], role: str) -> float:
    """Seconds spent in the hooks for one step that schedules every request once."""
    t0 = time.perf_counter()
    for r in reqs:
        side.get_num_new_matched_tokens(r, 0)
        side.update_state_after_alloc(r, r.blocks, len(r.prompt_token_ids) if role == "decode" else 0)
    new = [
        SimpleNamespace(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids, num_computed_tokens=0, block_ids=(r.block_ids,))
        for r in reqs
    ]
    output = SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens={r.request_id: len(r.prompt_token_ids) for r in reqs})
    side.build_connector_meta(output)
    for r in reqs:
        side.request_finished(r, r.block_ids)
    side.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}))
    return time.perf_counter() - t0


def measure(role: str, n: int, prompt_len: int, steps: int) -> dict[str, float]:
    cfg = parse_config("bench", "kv_consumer" if role == "decode" else "kv_producer", {})
    side = SchedulerSide(cfg, BLOCK_SIZE, 5710)
    # The fake objects are built outside the timed region; only the hooks are timed.
    batches = [_requests(n, prompt_len, role, s) for s in range(steps)]
    per_req_us = [one_step(side, reqs, role) / n * 1e6 for reqs in batches]
    return {"p50_us": statistics.median(per_req_us), "max_us": max(per_req_us)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = {role: measure(role, args.requests, args.prompt_len, args.steps) for role in ("decode", "prefill")}
    print(f"scheduler hooks, {args.requests} requests per step, {args.prompt_len}-token prompts, {args.steps} steps")
    for role, r in result.items():
        ok = "ok" if r["p50_us"] < 100 else "OVER 100 us"
        print(f"  {role:8s} {r['p50_us']:7.1f} us per request per step (p50), max {r['max_us']:7.1f}  {ok}")
    if args.json:
        print(json.dumps({"requests": args.requests, "prompt_len": args.prompt_len, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
