"""The Mooncake transport's handle of one posted transfer, shared by the transport and its peer threads."""

from __future__ import annotations

import dataclasses
import enum

from kv_connectors.errors import TransportError
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import Op, XferState


class Notify(str, enum.Enum):
    """The kind of send_notif's internal jobs: a MooncakeXfer that moves no data, only a notification."""

    NOTIF = "NOTIF"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(eq=False)
class MooncakeXfer:
    """Handle of one posted transfer (returned by post_read/post_write; pass it to poll/release)."""

    peer_name: str
    op: Op | Notify  # READ or WRITE (NOTIF for send_notif's internal jobs)
    num_runs: int
    nbytes: int
    num_batches: int
    _plan: TransferPlan | None = None
    _notif: str | None = None
    _state: XferState = XferState.IN_PROGRESS
    _error: TransportError | None = None
    _cancelled: bool = False
    _quiet: bool = False  # True for send_notif's internal jobs: errors are logged, nobody polls them
    _in_engine: bool = False  # a batch of it is inside the engine (submitted, not returned OK)
    _ended: bool = False  # no byte of it can move any more (settled)
    _session: str = ""  # the peer's engine address, probed while a failed batch may still land
