"""In-process transport and side channel over one `MemoryFabric`: real byte copies between
registered regions, injectable delays and faults, a clock the test controls. For unit tests of
the engine (receiver, sender, worker) without NIXL, Mooncake or sockets."""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kv_connectors import sidechannel, wire
from kv_connectors.errors import (
    NoAnswerError,
    PeerDisconnectedError,
    SideChannelBindError,
    TransportError,
)
from kv_connectors.layout import KVLayout
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import MemoryKind, XferState
from kv_connectors.transports.intervals import Ranges

Handler = Callable[[wire.Body], wire.Body]


_PICKED_PORTS = 40000  # where ports the fabric picks (serve on port 0) begin


class MemoryFabric:
    """What connects in-process peers: their transports by name, their side channels by address.

    Faults: `frozen` names agents whose transfers never complete and whose side channel never
    answers; `dead` names agents whose transfers and side channel fail at once; `sever(name)`
    breaks every connection to an agent, as UCX does once its keepalive gives up on a cut link:
    the transfers in flight over it end with PeerDisconnectedError, and each later post over it
    raises one until its initiator connects to that peer again (a new handshake).

    As the real engines: `release()` and `abort()` do not stop a transfer (UCX cannot cancel RMA,
    Mooncake finishes a submitted batch). A released transfer stays `loose` and still lands once
    it can (its peer not frozen, its delay passed), the next time anything on the fabric is
    polled or `drive()` runs; it ends without moving a byte only if a side dies or closes.
    `aborting=True` gives the old behaviour of this fake (release and abort stop it at once)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, aborting: bool = False) -> None:
        self.clock = clock
        self.aborting = aborting
        self.loose: list[MemoryXfer] = []  # released before they ended: still moving
        self.landed_late = 0  # loose transfers whose bytes landed after their release
        self.agents: dict[str, MemoryTransport] = {}
        self.servers: dict[tuple[str, int], MemoryServer] = {}
        self.frozen: set[str] = set()  # agent names or "host:port" side-channel addresses
        self.dead: set[str] = set()
        self.requests: list[wire.Body] = []  # every side-channel request, in order (tests count them)
        self.forgotten: list[tuple[str, int]] = []  # side-channel addresses a client forgot
        self.picked_ports = 0  # side channels served on port 0 so far

    # side channel -------------------------------------------------------------------------------
    def serve(
        self,
        host: str,
        port: int,
        compat_hash: str,
        handler: Handler,
        max_msg_bytes: int = 0,
        secret: bytes | None = None,
    ) -> MemoryServer:
        """max_msg_bytes and secret are the zmq server's business; the fabric ignores them. Port 0:
        one above 40000 that no server had before (as the system picks one for a real socket)."""
        if port == 0:  # never one picked before: a restarted peer's old port is not its new one
            self.picked_ports += 1
            port = _PICKED_PORTS + self.picked_ports
        if (host, port) in self.servers:
            raise SideChannelBindError(f"side channel {host}:{port} is in use")
        server = MemoryServer(self, host, port, compat_hash, handler)
        self.servers[(host, port)] = server
        return server

    def client(self) -> MemoryClient:
        return MemoryClient(self)

    def drive(self) -> int:
        """What the engines do in the background: every loose transfer that can complete now does
        (its bytes land, its notification goes out). Returns how many landed."""
        landed = 0
        for xfer in list(self.loose):
            assert xfer.owner is not None
            xfer.owner._try_complete(xfer)
            if xfer.state is XferState.DONE or xfer.error is not None:
                self.loose.remove(xfer)
                landed += xfer.state is XferState.DONE
        self.landed_late += landed
        return landed

    def sever(self, name: str) -> None:
        """Break every connection to and from agent `name` (see the class)."""
        for agent_name, agent in self.agents.items():
            for peer in list(agent._peers) if agent_name == name else agent._peers & {name}:
                agent._break(peer)


@dataclasses.dataclass
class MemoryServer:
    fabric: MemoryFabric
    host: str
    port: int
    compat_hash: str
    handler: Handler

    def answer(self, frame: bytes) -> bytes:
        """What SideChannelServer does with one frame, without the socket."""
        return sidechannel.answer(frame, self.compat_hash, self.handler)

    def close(self) -> None:
        self.fabric.servers.pop((self.host, self.port), None)


class MemoryClient:
    """The side-channel client over the fabric: answered at once (a completed future), or never
    (a frozen peer: the future stays pending, and the caller's deadline must end the wait)."""

    def __init__(self, fabric: MemoryFabric) -> None:
        self._fabric = fabric

    def submit(
        self, host: str, port: int, body: wire.Body, compat_hash: str, timeout_s: float
    ) -> concurrent.futures.Future[wire.Body]:
        future: concurrent.futures.Future[wire.Body] = concurrent.futures.Future()
        self._fabric.requests.append(body)
        address = f"{host}:{port}"
        if address in self._fabric.frozen:
            return future  # never answered
        try:
            future.set_result(self._request(host, port, body, compat_hash))
        except Exception as e:
            future.set_exception(e)
        return future

    def _request(self, host: str, port: int, body: wire.Body, compat_hash: str) -> wire.Body:
        server = self._fabric.servers.get((host, port))
        if server is None or f"{host}:{port}" in self._fabric.dead:
            raise NoAnswerError(f"no answer from side channel {host}:{port} (peer down?)")
        return sidechannel.reply_of(server.answer(wire.encode(body, compat_hash)), body, compat_hash, None, f"{host}:{port}")

    def forget(self, host: str, port: int) -> None:
        self._fabric.forgotten.append((host, port))

    def listening(self, host: str, port: int) -> concurrent.futures.Future[bool]:
        """A server is there and not dead (a frozen one's socket still accepts)."""
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        future.set_result((host, port) in self._fabric.servers and f"{host}:{port}" not in self._fabric.dead)
        return future

    def close(self) -> None:
        pass


@dataclasses.dataclass(eq=False)
class MemoryXfer:
    peer_name: str
    read: bool
    plan: TransferPlan
    notif: bytes
    ready_at: float
    target: MemoryTransport | None = None  # the peer incarnation posted to
    state: XferState = XferState.IN_PROGRESS
    error: TransportError | None = None
    owner: MemoryTransport | None = None  # the transport that posted it
    released: bool = False
    link: int = 0  # the connection's generation when posted (MemoryFabric.sever moves it on)


class MemoryTransport:
    """The Transport Protocol over process memory: a posted plan is copied (ctypes.memmove, every
    run checked against both sides' registered ranges) once `delay_s` has passed on the fabric's
    clock, at the first poll after that; then the notification reaches the peer."""

    def __init__(self, name: str, fabric: MemoryFabric, delay_s: float = 0.0) -> None:
        if name in fabric.agents:
            raise TransportError(f"agent name {name!r} is taken")
        self.name = name
        self.delay_s = delay_s
        self.fail_next_post: TransportError | None = None  # raised by the next post_read/post_write
        self._fabric = fabric
        self._ranges = Ranges()
        self._peers: set[str] = set()
        self._broken: set[str] = set()  # peers whose connection broke (MemoryFabric.sever)
        self._link: dict[str, int] = {}  # each peer connection's generation
        self._inbox: list[tuple[str, bytes]] = []
        self._closed = False
        self.posted = 0
        for agent in fabric.agents.values():  # a new process under a known name: links to the old one are dead
            if name in agent._peers:
                agent._break(name)
        fabric.agents[name] = self

    def register(self, layout: KVLayout, kind: MemoryKind = MemoryKind.HOST, device_id: int = 0) -> None:
        if kind is not MemoryKind.HOST:
            raise TransportError("the memory transport registers host memory only")
        self._ranges.add((r.base, r.base + r.span) for r in layout.regions)

    def local_metadata(self) -> bytes:
        return self.name.encode()

    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        if peer_metadata != peer_name.encode() or peer_name not in self._fabric.agents:
            raise TransportError(f"unknown peer {peer_name!r}")
        self._peers.add(peer_name)
        self._broken.discard(peer_name)

    def _break(self, peer_name: str) -> None:
        """The connection to peer_name broke (MemoryFabric.sever): posts fail until connect() again."""
        self._broken.add(peer_name)
        self._link[peer_name] = self._link.get(peer_name, 0) + 1

    def disconnect(self, peer_name: str) -> None:
        self._peers.discard(peer_name)
        self._broken.discard(peer_name)

    def _peer(self, peer_name: str) -> MemoryTransport:
        if self._closed:
            raise TransportError(f"memory transport {self.name} is closed")
        if peer_name not in self._peers:
            raise TransportError(f"peer {peer_name!r} is not connected")
        peer = self._fabric.agents.get(peer_name)
        if peer is None or peer_name in self._fabric.dead:
            raise PeerDisconnectedError(f"peer {peer_name!r} is gone")
        if peer_name in self._broken:
            raise PeerDisconnectedError(f"the connection to {peer_name!r} broke")
        return peer

    def post_read(self, peer_name: str, plan: TransferPlan, notif: bytes) -> MemoryXfer:
        return self._post(peer_name, plan, notif, read=True)

    def post_write(self, peer_name: str, plan: TransferPlan, notif: bytes) -> MemoryXfer:
        return self._post(peer_name, plan, notif, read=False)

    def _post(self, peer_name: str, plan: TransferPlan, notif: bytes, read: bool) -> MemoryXfer:
        peer = self._peer(peer_name)
        if self.fail_next_post is not None:
            error, self.fail_next_post = self.fail_next_post, None
            raise error
        remote, local = (plan.src, plan.dst) if read else (plan.dst, plan.src)
        _check(peer._ranges, remote, plan.length, f"{peer_name}'s memory")
        _check(self._ranges, local, plan.length, "our memory")
        self.posted += 1
        ready_at = self._fabric.clock() + self.delay_s
        xfer = MemoryXfer(peer_name, read, plan, notif, ready_at, peer, owner=self, link=self._link.get(peer_name, 0))
        self._try_complete(xfer)
        return xfer

    def _try_complete(self, xfer: MemoryXfer) -> None:
        if xfer.state is XferState.DONE or xfer.error is not None:
            return
        if xfer.peer_name in self._fabric.dead:
            xfer.error = PeerDisconnectedError(f"peer {xfer.peer_name!r} died mid-transfer")
            return
        if self._closed:
            xfer.error = TransportError(f"memory transport {self.name} closed mid-transfer")
            return
        if self._fabric.agents.get(xfer.peer_name) is not xfer.target:  # its memory may be freed: copy nothing
            xfer.error = PeerDisconnectedError(f"peer {xfer.peer_name!r} closed mid-transfer")
            return
        if xfer.link != self._link.get(xfer.peer_name, 0):
            xfer.error = PeerDisconnectedError(f"the connection to {xfer.peer_name!r} broke mid-transfer")
            return
        if xfer.peer_name in self._fabric.frozen or self._fabric.clock() < xfer.ready_at:
            return
        for src, dst, n in xfer.plan.runs():
            ctypes.memmove(dst, src, n)
        xfer.state = XferState.DONE
        if xfer.notif:
            self.send_notif(xfer.peer_name, xfer.notif)

    def poll(self, handle: MemoryXfer) -> XferState:
        if handle.released:
            raise TransportError("handle was released (its transfer may still land)")
        self._fabric.drive()
        self._try_complete(handle)
        if handle.error is not None:
            raise handle.error
        return handle.state

    def abort(self, handle: MemoryXfer) -> None:
        """Aborting fabric: ends the transfer now. Otherwise, as UCX's RMA: nothing."""
        if self._fabric.aborting and not self.settled(handle):
            handle.error = TransportError("aborted before completion")

    def settled(self, handle: MemoryXfer) -> bool:
        """Completed, or ended without moving a byte (a side died or closed; aborted on an aborting fabric)."""
        if not handle.released:
            self._try_complete(handle)
        return handle.state is XferState.DONE or handle.error is not None

    def release(self, handle: MemoryXfer) -> None:
        if handle.released:
            return
        handle.released = True
        if self.settled(handle):
            return
        if self._fabric.aborting:
            handle.error = TransportError("released before completion")
        else:
            self._fabric.loose.append(handle)  # it runs on: its bytes may still land

    def send_notif(self, peer_name: str, msg: bytes) -> None:
        peer = self._peer(peer_name)
        peer._inbox.append((self.name, bytes(msg)))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        if self._closed:
            raise TransportError(f"memory transport {self.name} is closed")
        self._fabric.drive()
        out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        self._closed = True
        self._ranges = Ranges()
        if self._fabric.agents.get(self.name) is self:
            del self._fabric.agents[self.name]


def _check(ranges: Ranges, addr: np.ndarray, length: np.ndarray, what: str) -> None:
    bad = ranges.first_outside(addr, length)
    if bad is not None:
        a, n = int(addr[bad]), int(length[bad])
        raise TransportError(f"run [{a:#x}, +{n}) is outside {what}'s registered regions")


def host_layout(buf: Any, num_blocks: int, block_size: int, num_regions: int = 2) -> KVLayout:
    """A layout over a numpy buffer: num_regions regions of num_blocks packed blocks each (a test KV cache)."""
    from kv_connectors.layout import Region

    arr = np.asarray(buf)
    region_bytes = arr.nbytes // num_regions
    seg = region_bytes // num_blocks
    base = arr.ctypes.data
    regions = tuple(Region(base + i * region_bytes, seg, seg, num_blocks) for i in range(num_regions))
    return KVLayout(num_blocks, block_size, regions)
