"""The transport Protocol every engine (NIXL, Mooncake) implements; errors map to kv_connectors.errors."""

from __future__ import annotations

import enum
from typing import Any, Protocol

from kv_connectors.layout import KVLayout
from kv_connectors.plan import TransferPlan


class XferState(enum.Enum):
    """State of one posted transfer, as seen by its initiator."""

    IN_PROGRESS = "in_progress"
    DONE = "done"


class Op(str, enum.Enum):
    """What a posted plan does: READ copies the peer's memory into ours, WRITE ours into the peer's.

    A str (the engines' own spelling, "READ" / "WRITE"); str() and formatting give the bare value."""

    READ = "READ"
    WRITE = "WRITE"

    def __str__(self) -> str:
        return self.value


class MemoryKind(enum.Enum):
    """Where the registered KV cache lives."""

    HOST = "host"
    DEVICE = "device"


class Transport(Protocol):
    """Moves planned byte runs between this process's registered KV cache and a connected peer's.

    A transfer is over only when its engine says so: `poll` DONE, or `settled` after a failure or
    an abort. Until then its memory (ours and the peer's) may still be read or written.

    Every method raises only kv_connectors.errors types (TransportError and subclasses).
    Not thread-safe: one thread drives a transport.
    """

    @property
    def name(self) -> str:
        """This agent's unique name (peers address us by it)."""

    def register(self, layout: KVLayout, kind: MemoryKind = MemoryKind.HOST, device_id: int = 0) -> None:
        """Register every region of the layout with the engine."""

    def local_metadata(self) -> bytes:
        """Opaque bytes a peer needs to connect to us (sent in the handshake)."""

    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        """Make a peer known; connecting an already known name replaces it (restarted peer)."""

    def disconnect(self, peer_name: str) -> None:
        """Forget a peer; unknown names are ignored."""

    def post_read(self, peer_name: str, plan: TransferPlan, notif: bytes) -> Any:
        """Start copying plan.src (peer memory) into plan.dst (ours); notif reaches the peer when done."""

    def post_write(self, peer_name: str, plan: TransferPlan, notif: bytes) -> Any:
        """Start copying plan.src (ours) into plan.dst (peer memory); notif reaches the peer when done."""

    def poll(self, handle: Any) -> XferState:
        """Progress of a posted transfer; raises PeerDisconnectedError / TransportError on failure."""

    def abort(self, handle: Any) -> None:
        """Stop what of a transfer has not started yet, where the engine can (Mooncake: its later
        batches; NIXL and UCX: nothing, RMA cannot be cancelled). Bytes already submitted may still
        move: ask `settled` until it says so. Never raises."""

    def settled(self, handle: Any) -> bool:
        """Whether no byte of this transfer can move any more: it completed, or it failed in a way
        its engine guarantees stopped it (each transport says which). Never raises."""

    def release(self, handle: Any) -> None:
        """Forget a handle. It does not stop the bytes: a transfer released before it settled may
        still read or write its memory later (UCX cannot cancel RMA, Mooncake finishes a submitted
        batch); memory it writes is safe to reuse only once `settled` said so. Never raises."""

    def send_notif(self, peer_name: str, msg: bytes) -> None:
        """Send a small message to a connected peer (no data transfer)."""

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Messages received since the last call, as (peer name, message)."""

    def close(self) -> None:
        """Deregister memory and release the engine. Never raises."""
