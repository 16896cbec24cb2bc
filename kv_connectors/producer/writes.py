"""P's writes into D's blocks (push), from posting until they ended: whole requests, or layer by
layer during the forward pass once the device ran each layer's kernels. A write that fails, times
out or that D aborts is not over when released: D is told it failed, and the blocks it reads are
let go, only once its transport says no byte of it can move any more."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from kv_connectors import wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.errors import KVConnectorError, TransferParamsError
from kv_connectors.groups import pair_tails, split
from kv_connectors.layout import KVLayout
from kv_connectors.plan import TokenRange, TransferPlan, plan_blocks
from kv_connectors.producer.admission import PushBook
from kv_connectors.producer.leases import other_prompt
from kv_connectors.transports.base import Transport, XferState

logger = logging.getLogger(__name__)

OTHER_PROMPT = "the decode request's prompt is not the prefill's (one id used for two prompts?)"
ABORTED = "the consumer aborted the push request"

# The device has run the kernels queued before the signal was made (a CUDA event's query(), from the
# adapter): on a GPU a layer's KV is in the cache only once its kernels ran, not when its hook returned.
Ready = Callable[[], bool]


class WriteKey(NamedTuple):
    """One push: two D requests for one lease (a router's duplicate) are two writes, each answered."""

    lease: str  # the lease key D names the blocks by
    agent: str  # the consumer rank's agent
    request: str  # its request there


# A consumer rank is done with a lease: (key, D's engine id, its rank, now).
ReaderDone = Callable[[str, str, int, float], None]


@dataclasses.dataclass(frozen=True)
class Unwritable:
    """Why a push cannot be written into D's blocks (told to D as the push's failure)."""

    reason: str


@dataclasses.dataclass
class Write:
    """One push: D's request, then the posted write(s) from P's blocks into D's."""

    request: wire.PushRequest
    deadline: float
    handles: list[Any] = dataclasses.field(default_factory=list)
    runs: int = 0
    nbytes: int = 0
    received_at: float = 0.0  # D's request reached the side channel (P's clock)
    posted_at: float = 0.0  # the (first) write was posted
    # Layer-wise only: P's blocks of the request, D's layout, regions not written yet.
    src_blocks: tuple[int, ...] = ()
    dst: KVLayout | None = None
    regions_left: set[int] = dataclasses.field(default_factory=set)
    layers_in_forward: int = 0  # layers written from save_kv_layer, during the forward pass
    error: str = ""  # failed (or not every region written): it ends once every handle settled
    stopping: str = ""  # timed out or aborted by D: its handles are aborted; a write that lands whole still counts
    consumer: KVLayout | None = None  # D's layout when it asked: the process whose blocks these are
    aborted: set[int] = dataclasses.field(default_factory=set)  # id() of handles told to abort
    # Layer-wise: regions whose KV the device has not finished writing yet, with the signal that says so.
    pending: list[tuple[tuple[int, ...], Ready]] = dataclasses.field(default_factory=list)


def other_prompt_reason(req: wire.PushRequest, digest: str) -> str | None:
    """Why a push request is not for this prefill's KV (D's prompt is another), or None: the same
    prompt, or a side that stated no digest. Under a transfer id a router reused for two prompts,
    writing would have D answer its prompt from another prompt's KV."""
    if not other_prompt(req.prompt_digest, digest):
        return None
    return f"decode request {req.consumer_request_id} under {req.producer_request_id!r}: {OTHER_PROMPT}; not written"


def plan_write(
    layout: KVLayout,
    own: tuple[int, ...],
    dst: KVLayout,
    req: wire.PushRequest,
    regions: Sequence[int] | None = None,
    own_sizes: tuple[int, ...] = (),
) -> TransferPlan:
    """P's blocks into D's (these regions only, if given): paired from the tail where both sides'
    blocks hold as many tokens (head slices planned where the TP sizes differ; D's own prefix-cache
    hits are not sent), else the tokens D asked for, mapped through both block tables. A hybrid's
    (own_sizes: P's blocks per KV cache group; D's in the request) group by group, each from its tail."""
    src, to = (layout, dst) if regions is None else (layout.select(regions), dst.select(regions))
    if own_sizes or req.group_sizes:
        if len(req.group_sizes) != len(own_sizes):
            raise TransferParamsError(
                f"the push request names {len(req.group_sizes) or 1} KV cache group(s), the prefill holds {len(own_sizes) or 1}"
            )
        local, remote, _ = pair_tails(split(req.block_ids, req.group_sizes), split(own, own_sizes))
        return plan_blocks(src, remote, to, local)
    # The push request's token range, as the wire carries it: P's own blocks hold the prompt from token 0.
    tokens = TokenRange(req.first_token, req.num_tokens, src_start=0, dst_start=req.consumer_first_token)
    if tokens.pairs_blocks(layout, dst):
        tail = own[len(own) - len(req.block_ids) :]
        return plan_blocks(src, tail, to, req.block_ids)
    return tokens.plan(src, own, to, req.block_ids)


class Writes:
    """Engine thread only. Counts pushes (written whole), layer-wise ones and failures."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        transport: Transport,
        layout: KVLayout,
        compat_hash: str,
        layer_regions: Mapping[str, Sequence[int]],
        *,
        book: PushBook,
        clock: Callable[[], float],
        reader_done: ReaderDone,
    ) -> None:
        self._cfg = cfg
        self._transport = transport
        self._layout = layout
        self._hash = compat_hash
        self._layer_regions = {name: tuple(ids) for name, ids in layer_regions.items()}
        self._book = book
        self._clock = clock
        self._reader_done = reader_done
        self._writing: dict[WriteKey, Write] = {}
        self._layerwise: dict[WriteKey, Write] = {}  # writes following this step's forward pass
        self.pushes = 0
        self.failures = 0
        self.layerwise_pushes = 0

    @property
    def layerwise(self) -> bool:
        """Layer-wise push is on (a layer map was given: not staged, not turned off)."""
        return bool(self._layer_regions)

    def from_key(self, key: str) -> bool:
        """A write from the blocks held under key is in flight (or follows this step's forward pass)."""
        return any(wk.lease == key for wk in self._writing) or any(wk.lease == key for wk in self._layerwise)

    def agents(self) -> set[str]:
        """Consumer agents with a write in flight."""
        return {wk.agent for wk in (*self._writing, *self._layerwise)}

    def busy(self) -> bool:
        return bool(self._writing or self._layerwise)

    def writes_layers(self) -> bool:
        return bool(self._layerwise)

    # whole requests ---------------------------------------------------------------------------
    def post(
        self, wk: WriteKey, write: Write, own: tuple[int, ...], dst: KVLayout | Unwritable, own_sizes: tuple[int, ...] = ()
    ) -> None:
        """Post a write of P's blocks own into D's (dst: D's layout, or why it cannot be written;
        own_sizes: a hybrid's blocks per KV cache group)."""
        req = write.request
        try:
            if isinstance(dst, Unwritable):
                raise KVConnectorError(dst.reason)
            plan = plan_write(self._layout, own, dst, req, own_sizes=own_sizes)
            write.runs, write.nbytes = plan.num_runs, plan.total_bytes
            notif = self._done(req, runs=plan.num_runs)
            if not self._book.start(req):  # D aborted it meanwhile (side-channel thread): never written
                return
            try:
                write.handles.append(self._transport.post_write(req.consumer_agent, plan, notif))
            except BaseException:
                self._book.end(req)  # nothing was posted
                raise
        except Exception as e:  # KVConnectorError, or a peer's layout/ids the planner cannot use
            self.finish(write, f"write failed: {e}")
            self._reader_done(wk.lease, req.consumer_engine_id, req.consumer_rank, self._clock())
            return
        write.posted_at = self._clock()
        self._writing[wk] = write  # its blocks are held until it settles (SendLeases: writing)

    # layer by layer ---------------------------------------------------------------------------
    def begin_layerwise(self, wk: WriteKey, write: Write, src_blocks: tuple[int, ...], dst: KVLayout) -> bool:
        """Write this request layer by layer in the coming forward pass (False: D aborted it)."""
        if not self._book.start(write.request):
            return False
        write.src_blocks, write.dst = src_blocks, dst
        write.regions_left = set(range(len(self._layout.regions)))
        self._layerwise[wk] = write
        return True

    def on_layer_saved(self, layer_name: str, ready: Ready | None = None) -> None:
        """A layer's attention op returned: write its regions of every layer-wise push once its KV is
        in the cache (ready: the device ran the kernels that fill it; None: it is, as on a CPU)."""
        if not self._layerwise:
            return
        regions = self._layer_regions.get(layer_name, ())
        for write in self._layerwise.values():
            write.layers_in_forward += 1
            self._write_regions(write, regions, ready)

    def end_layerwise(self, ready: Ready | None = None) -> None:
        """After the forward pass: write what no layer hook covered (once the pass's kernels ran:
        ready); then wait for completion."""
        for wk in list(self._layerwise):
            write = self._layerwise.pop(wk)
            self._write_regions(write, tuple(write.regions_left), ready)
            self._writing[wk] = write

    def cancel(self, key: str, reason: str) -> None:
        """P's request under key ended without KV for D: its layer-wise writes stop (their handles
        settle in poll, which then tells D)."""
        for wk in [wk for wk in self._layerwise if wk.lease == key]:
            write = self._writing[wk] = self._layerwise.pop(wk)
            write.error = reason
            write.regions_left.clear()

    def _write_regions(self, write: Write, regions: Sequence[int], ready: Ready | None) -> None:
        """Post these regions now if their KV is in the cache, else once it is (poll)."""
        todo = tuple(sorted(r for r in regions if r in write.regions_left))
        if not todo or write.error:
            return
        write.regions_left.difference_update(todo)
        if ready is None or ready():
            self._post_regions(write, todo)
        else:
            write.pending.append((todo, ready))

    def _post_pending(self, write: Write) -> None:
        """Post the pending regions whose KV the device has written (in order: a later signal is
        never ready before an earlier one); none once the write failed or stops."""
        if write.error or write.stopping:
            if write.pending:
                write.error = write.error or write.stopping  # regions left unwritten: it fails
                write.pending.clear()
            return
        while write.pending and write.pending[0][1]():
            regions, _ready = write.pending.pop(0)
            self._post_regions(write, regions)

    def _post_regions(self, write: Write, todo: Sequence[int]) -> None:
        """Post a write of these regions; a failure marks the write, which poll ends."""
        if write.error:
            return
        if self._book.aborted(write.request):  # D gave up: no more of it is written
            write.error = ABORTED
            write.regions_left.clear()
            return
        req = write.request
        assert write.dst is not None
        try:
            plan = plan_write(self._layout, write.src_blocks, write.dst, req, todo)
            write.runs += plan.num_runs
            write.nbytes += plan.total_bytes
            write.handles.append(self._transport.post_write(req.consumer_agent, plan, b""))
            write.posted_at = write.posted_at or self._clock()
        except Exception as e:  # KVConnectorError, or a peer's layout/ids the planner cannot use
            write.error = f"layer-wise write failed: {e}"
            write.regions_left.clear()

    # completion -------------------------------------------------------------------------------
    def poll(self, now: float) -> None:
        for wk in list(self._writing):
            self._poll(wk, self._writing[wk], now)

    def _poll(self, wk: WriteKey, write: Write, now: float) -> None:
        """A write ends once every handle completed, or, after a failure, a timeout or D's abort,
        once every handle settled (no byte of it can land any more): only then is D told and are
        the blocks it reads let go."""
        if not write.stopping and self._book.aborted(write.request):
            write.stopping = ABORTED
        if not write.stopping and now > write.deadline:
            write.stopping = f"write timed out after {self._cfg.transfer_timeout_s:g} s"
        self._post_pending(write)
        for handle in list(write.handles):
            try:
                state: XferState | None = self._transport.poll(handle)
            except KVConnectorError as e:
                write.error = write.error or f"write failed: {e}"
                state = None
            if state is XferState.DONE:
                self._transport.release(handle)
                write.handles.remove(handle)
                continue
            if write.error or write.stopping:
                if id(handle) not in write.aborted:
                    write.aborted.add(id(handle))
                    self._transport.abort(handle)
                if self._transport.settled(handle):  # ended without completing (or so its engine says)
                    write.error = write.error or write.stopping
                    self._transport.release(handle)
                    write.handles.remove(handle)
        if write.handles or write.pending:
            return  # in flight, settling, or waiting for the device
        del self._writing[wk]
        req = write.request
        self._book.end(req)
        self._reader_done(wk.lease, req.consumer_engine_id, req.consumer_rank, now)  # written or failed: free either way
        if write.error:
            self.finish(write, write.error)
            return
        self.pushes += 1
        if write.received_at and write.posted_at:  # where a push's time went: D's "kv load" line's twin
            ended = max(now, write.posted_at)  # `now` is the poll round's start: a write can end in the round it was posted
            logger.info(
                "kv push request=%s consumer=%s rank=%d bytes=%d descriptors=%d wait_ms=%.3f write_ms=%.3f total_ms=%.3f",
                req.producer_request_id,
                req.consumer_engine_id,
                req.consumer_rank,
                write.nbytes,
                write.runs,
                (write.posted_at - write.received_at) * 1e3,
                (ended - write.posted_at) * 1e3,
                (ended - write.received_at) * 1e3,
            )
        if write.dst is not None:  # layer-wise: the notification follows the last write
            self.layerwise_pushes += int(write.layers_in_forward > 0)
            self._notify(write.request, self._done(write.request, runs=write.runs))

    def _done(self, req: wire.PushRequest, error: str = "", runs: int = 0) -> bytes:
        return wire.encode(
            wire.TransferDone(req.consumer_request_id, self._cfg.engine_id, error, runs, attempt=req.attempt), self._hash
        )

    def dropped(self) -> None:
        """A push D aborted before anything of it was posted: counted as failed, D told nothing (it gave up)."""
        self.failures += 1

    def finish(self, write: Write, error: str) -> None:
        """Tell D its push failed: nothing of it is in flight, and it is never written from now on
        (a copy of the request arriving later is refused). Best effort: D's abort covers a lost message."""
        self.failures += 1
        req = write.request
        self._book.close(req)
        if error == ABORTED:
            logger.info("push of %s to %s ended: %s", req.producer_request_id, req.consumer_engine_id, error)
        else:
            logger.error("push of %s to %s failed: %s", req.producer_request_id, req.consumer_engine_id, error)
        self._notify(req, self._done(req, error))

    def _notify(self, req: wire.PushRequest, msg: bytes) -> None:
        try:
            self._transport.send_notif(req.consumer_agent, msg)
        except KVConnectorError as e:
            logger.debug("could not tell %s: %s", req.consumer_engine_id, e)

    def close(self) -> None:
        for write in [*self._writing.values(), *self._layerwise.values()]:
            for handle in write.handles:
                self._transport.release(handle)
        self._writing.clear()
        self._layerwise.clear()
