"""The doctor's measured transfers: READ (bytes verified) and WRITE of scattered blocks, in alternating rounds."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kv_connectors.errors import KVConnectorError
from kv_connectors.layout import KVLayout
from kv_connectors.plan import plan_transfer
from kv_connectors.transports.base import Transport, XferState

BLOCK_BYTES = 16 * 1024
ROUNDS = 3  # READ then WRITE, this many times: the medians are reported, every round kept
_XFER_S = 20.0  # a probe transfer finishes within this


def pattern(num_blocks: int) -> np.ndarray:
    """Block b holds (b % 251) + 1 in every byte: a copy is checked by one byte per block."""
    return np.repeat((np.arange(num_blocks) % 251 + 1).astype(np.uint8), BLOCK_BYTES)


def _wait(t: Transport, handle: Any) -> None:
    deadline = time.monotonic() + _XFER_S
    while t.poll(handle) is not XferState.DONE:
        if time.monotonic() > deadline:
            t.release(handle)
            raise KVConnectorError(f"a probe transfer did not finish within {_XFER_S:g} s")
    t.release(handle)


def timed_ops(
    t: Transport,
    peer: str,
    peer_layout: KVLayout,
    local_layout: KVLayout,
    buf: np.ndarray,
    seconds: float,
    rounds: int = ROUNDS,
) -> dict[str, Any]:
    """GB/s of READ (bytes verified against pattern()) and WRITE of every block in shuffled order, in
    `rounds` alternating rounds of at least `seconds / rounds` each (and one transfer), after one
    unmeasured transfer each way: the medians as read_gbps / write_gbps, each round in read_rounds /
    write_rounds."""
    num_blocks = local_layout.num_blocks
    rng = np.random.default_rng(0)
    src = rng.permutation(num_blocks).tolist()
    dst = rng.permutation(num_blocks).tolist()
    plans = {
        "read": plan_transfer(peer_layout, src, local_layout, dst),
        "write": plan_transfer(local_layout, dst, peer_layout, src),
    }
    measured: dict[str, list[float]] = {"read": [], "write": []}
    for op, plan in plans.items():  # unmeasured: the first transfer each way also sets up the connection
        _wait(t, t.post_read(peer, plan, b"") if op == "read" else t.post_write(peer, plan, b""))
    for _ in range(max(1, rounds)):
        for op, plan in plans.items():
            moved, started = 0, time.monotonic()
            while moved == 0 or time.monotonic() - started < seconds / max(1, rounds):
                _wait(t, t.post_read(peer, plan, b"") if op == "read" else t.post_write(peer, plan, b""))
                moved += plan.total_bytes
            measured[op].append(round(moved / (time.monotonic() - started) / 1e9, 3))
            if op == "read":
                got = buf.reshape(num_blocks, BLOCK_BYTES)[dst, 0]
                if not np.array_equal(got, (np.asarray(src) % 251 + 1).astype(np.uint8)):
                    raise KVConnectorError("the probe's READ moved the wrong bytes")
    out: dict[str, Any] = {}
    for op, values in measured.items():
        out[f"{op}_gbps"] = float(np.median(values))
        out[f"{op}_rounds"] = values
    out["descriptors"] = plans["read"].num_runs
    return out
