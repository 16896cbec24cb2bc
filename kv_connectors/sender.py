"""P side of a transfer: leases on blocks held for D, and writes into D's blocks when D asks (push)."""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from typing import Any

from kv_connectors import wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.errors import KVConnectorError
from kv_connectors.layout import KVLayout
from kv_connectors.plan import plan_transfer
from kv_connectors.state import SendLeases
from kv_connectors.transport import Transport, XferState

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Write:
    request: wire.PushRequest
    deadline: float
    handle: Any = None


class Sender:
    """Owns P's leases and push writes. Side-channel callbacks (other thread) only enqueue;
    every transport call happens in progress()/take_finished() on the engine's thread."""

    def __init__(self, cfg: ConnectorConfig, transport: Transport, layout: KVLayout, compat: wire.CompatInfo) -> None:
        self._cfg = cfg
        self._transport = transport
        self._layout = layout
        self._hash = compat.hash()
        self.leases = SendLeases()
        self._inbox: queue.SimpleQueue[wire.HandshakeRequest | wire.PushRequest] = queue.SimpleQueue()
        self._consumers: dict[str, KVLayout] = {}  # agent name -> layout
        self._waiting: dict[str, _Write] = {}  # push requests whose lease is not known yet
        self._writing: dict[str, _Write] = {}
        self.pushes = 0
        self.push_failures = 0

    # side-channel thread ------------------------------------------------------------------------
    def on_handshake(self, request: wire.HandshakeRequest) -> None:
        if request.agent_name and request.layout is not None:
            self._inbox.put(request)

    def on_push(self, request: wire.PushRequest) -> wire.PushAck:
        self._inbox.put(request)
        return wire.PushAck(True)

    # engine thread ----------------------------------------------------------------------------
    def add_leases(self, reqs: dict[str, tuple[int, ...]]) -> None:
        now = time.monotonic()
        for rid, block_ids in reqs.items():
            self.leases.add(rid, block_ids, now, self._cfg.lease_s)

    def progress(self) -> None:
        now = time.monotonic()
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, wire.HandshakeRequest):
                self._connect(msg)
            elif not msg.block_ids:
                self.leases.notice(msg.producer_request_id, now)  # D needs nothing: free now
            else:
                self._waiting[msg.producer_request_id] = _Write(msg, now + self._cfg.transfer_timeout_s)
        for rid in list(self._waiting):
            write = self._waiting[rid]
            if self.leases.block_ids(rid) is not None:
                del self._waiting[rid]
                self._post(rid, write)
            elif now > write.deadline:
                del self._waiting[rid]
                self._finish(write, f"prefill request {rid} is unknown here or its blocks were already freed")
        for rid in list(self._writing):
            self._poll(rid, self._writing[rid], now)

    def _connect(self, request: wire.HandshakeRequest) -> None:
        assert request.layout is not None
        try:
            self._transport.connect(request.agent_name, request.agent_metadata)
            self._consumers[request.agent_name] = request.layout.to_layout()
            logger.info("consumer %s connected", request.engine_id)
        except KVConnectorError as e:
            logger.error("cannot connect consumer %s: %s", request.engine_id, e)

    def _post(self, rid: str, write: _Write) -> None:
        req = write.request
        own = self.leases.block_ids(rid)
        assert own is not None
        dst = self._consumers.get(req.consumer_agent)
        if dst is None:
            self._finish(write, f"consumer {req.consumer_agent} did not hand-shake for push")
            self.leases.notice(rid, time.monotonic())
            return
        if len(req.block_ids) > len(own):
            self._finish(write, f"asked for {len(req.block_ids)} blocks, request {rid} holds {len(own)}")
            self.leases.notice(rid, time.monotonic())
            return
        try:
            plan = plan_transfer(self._layout, own[len(own) - len(req.block_ids) :], dst, req.block_ids)
            done = wire.TransferDone(req.consumer_request_id, self._cfg.engine_id, runs=plan.num_runs)
            notif = wire.encode(done, self._hash)
            write.handle = self._transport.post_write(req.consumer_agent, plan, notif)
        except KVConnectorError as e:
            self._finish(write, f"write failed: {e}")
            self.leases.notice(rid, time.monotonic())
            return
        self.leases.hold(rid)
        write.deadline = time.monotonic() + self._cfg.transfer_timeout_s
        self._writing[rid] = write

    def _poll(self, rid: str, write: _Write, now: float) -> None:
        try:
            state = self._transport.poll(write.handle)
        except KVConnectorError as e:
            error = f"write failed: {e}"
        else:
            if state is XferState.IN_PROGRESS and now <= write.deadline:
                return
            error = "" if state is XferState.DONE else f"write timed out after {self._cfg.transfer_timeout_s:g} s"
        self._transport.release(write.handle)
        del self._writing[rid]
        self.leases.notice(rid, now)  # written or failed: P's blocks are free either way
        if error:
            self._finish(write, error)
        else:
            self.pushes += 1

    def _finish(self, write: _Write, error: str) -> None:
        """Tell D its push failed (best effort: D's own deadline covers a lost message)."""
        self.push_failures += 1
        req = write.request
        logger.error("push of %s to %s failed: %s", req.producer_request_id, req.consumer_engine_id, error)
        msg = wire.encode(wire.TransferDone(req.consumer_request_id, self._cfg.engine_id, error), self._hash)
        try:
            self._transport.send_notif(req.consumer_agent, msg)
        except KVConnectorError as e:
            logger.debug("could not tell %s: %s", req.consumer_engine_id, e)

    def take_finished(self, notices: list[wire.TransferDone]) -> set[str]:
        """Request ids whose blocks can be freed: read (D's notices), written, or lease expired."""
        now = time.monotonic()
        for notice in notices:
            self.leases.notice(notice.request_id, now)
        done, expired = self.leases.take_finished(now)
        for rid in expired:
            logger.warning("request %s: decode side never read its KV; freed after %.0f s lease", rid, self._cfg.lease_s)
        return done | expired

    def close(self) -> None:
        for write in self._writing.values():
            self._transport.release(write.handle)
        self._writing.clear()
