"""Fragmented staging: which plans a StagedTransport that also registered the KV cache with its inner
transport moves through the pool, and the handle of a plan it moved directly.

A plan of many short runs costs an engine a request per run (Mooncake over TCP: ~30 us per 16 KiB
run, 0.48-0.58 GB/s here, against 1.0-1.2 GB/s through a 128 MiB pool in 16 MiB chunks); gathered
into a pool slot it moves as a few large runs. A short plan, or one of long runs, moves faster
directly: the pool costs its messages' round trips (a one-block transfer: ~0.7 ms directly, 2.4-4.7
ms staged)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kv_connectors.errors import ConfigError
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import Op


@dataclasses.dataclass(frozen=True)
class FragmentRule:
    """A plan goes through the pool when it has at least min_runs runs averaging under max_mean_run bytes."""

    min_runs: int
    max_mean_run: int

    def __post_init__(self) -> None:
        if self.min_runs < 1 or self.max_mean_run < 1:
            raise ConfigError(f"a fragment rule needs min_runs >= 1 and max_mean_run >= 1, got {self}")

    def staged(self, plan: TransferPlan) -> bool:
        runs = plan.num_runs
        return runs >= self.min_runs and plan.total_bytes < runs * self.max_mean_run


@dataclasses.dataclass(eq=False)
class DirectXfer:
    """Handle of a plan a fragmented StagedTransport moved with its inner transport (`inner` is that
    transport's handle: poll, abort, settled and release go to it)."""

    peer_name: str
    op: Op
    num_runs: int
    nbytes: int
    inner: Any
