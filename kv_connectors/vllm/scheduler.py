"""Scheduler side of the connector: decides what each request loads or hands off, and builds metadata."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kv_connectors.config import ConnectorConfig
from kv_connectors.errors import TransferParamsError
from kv_connectors.groups import CacheGroups, flatten
from kv_connectors.logutil import RateLimitedLog
from kv_connectors.params import (
    NO_PARAMS,
    RemotePrefill,
    RequestParams,
    parse_request_params,
    producer_params,
    prompt_digest,
)
from kv_connectors.plan import TokenRange
from kv_connectors.specs import ProducerAddress
from kv_connectors.vllm.compat import FINISHED_NORMALLY
from kv_connectors.vllm.loads import Checked, check_load, covered_digest, pair_blocks
from kv_connectors.vllm.metadata import ConnectorMetadata, RecvSpec, SendSpec
from kv_connectors.vllm.stats import REQUESTS_WITHOUT_PARAMS, KvcStats

logger = logging.getLogger(__name__)
_limited = RateLimitedLog(logger, interval_s=60.0)


class SchedulerSide:
    """Runs in the EngineCore process; never blocks and never raises for a single bad request."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        block_size: int,
        rank_port: int,
        clock: Callable[[], float] = time.monotonic,
        tp_size: int = 1,
        groups: CacheGroups | None = None,
    ) -> None:
        self._cfg = cfg
        self._tp_size = tp_size
        # The model's KV cache groups; a hybrid's requests move every group's blocks (kv_connectors.groups).
        self._groups = groups if groups is not None else CacheGroups(())
        self._clock = clock
        self._block_size = block_size
        self._port = rank_port
        # Each request's kv_transfer_params, parsed once (when first seen), until it finishes.
        self._params: dict[str, RequestParams] = {}
        # Parsed params (or the reason they are bad) of requests that asked for a remote prefill.
        self._pending: dict[str, Checked] = {}
        self._consumed: set[str] = set()  # loaded once: never load again (e.g. after preemption)
        # P: requests sent with a transfer id (D may be waiting already) -> that id.
        self._transfer_ids: dict[str, str] = {}
        self._layerwise: set[str] = set()  # P: requests whose layers the worker may be writing
        # D: requests waiting in D's queue -> (arrival, P's side channel, P's key), in arrival order;
        # past lease_renew_after_s they move to _renewing and the worker keeps P's lease alive.
        self._queued: dict[str, tuple[float, ProducerAddress, str, int | None]] = {}
        self._renewing: set[str] = set()
        self._meta = ConnectorMetadata()
        # D only (kv_consumer): requests that came without P's kv_transfer_params (computed here).
        self._count_unpaired = cfg.role.consumes and not cfg.role.produces
        self._unpaired = 0  # in total
        self._unpaired_reported = 0  # of which in stats already

    def _params_of(self, request: Any) -> RequestParams:
        """The request's kv_transfer_params, parsed the first time it is seen."""
        rid = request.request_id
        parsed = self._params.get(rid)
        if parsed is None:
            parsed = parse_request_params(request.kv_transfer_params)
            if parsed is NO_PARAMS:
                return parsed  # nothing to keep for a request without params
            self._params[rid] = parsed
            if parsed.transfer_id_error is not None:
                logger.warning("request %s: %s; its decode side cannot find its KV", rid, parsed.transfer_id_error)
        return parsed

    def on_new_request(self, request: Any) -> None:
        """D: a request arrived; while it waits in D's queue, P's lease must not run out."""
        params = self._params_of(request)
        if self._count_unpaired and not params.remote_prefill:
            self._unpaired_request()
        rp = params.prefill
        if rp is None:
            return  # no remote prefill; or bad params: failed (and P told) when the scheduler looks at it
        self._queued[request.request_id] = (self._clock(), rp.peer_key, rp.remote_request_id, rp.remote_tp_size)

    def _unpaired_request(self) -> None:
        """A decode-only instance got a request without P's kv_transfer_params: it computes the prompt
        itself. Now and then is a proxy's choice; every request is a router that is not disaggregating."""
        self._unpaired += 1
        _limited.warning(
            "unpaired",
            "%d request(s) so far reached this decode instance (kv_consumer) without a prefill instance's "
            "kv_transfer_params (do_remote_prefill): it computed their prompts itself and loaded no KV. If every "
            "request arrives so, the router in front is not disaggregating: it must send each request to a prefill "
            'instance first with kv_transfer_params {"do_remote_decode": true} and copy the kv_transfer_params of '
            "its answer into the decode request (smg does so only for workers registered with "
            '"kv_connector":"NixlConnector" through POST /workers, not for plain --prefill/--decode URLs). '
            "A proxy that sends short prompts to decode alone on purpose (kv-connectors-proxy --local-prefill-below, "
            "its decode-only fallback) is counted too (kvc:%s_total)",
            self._unpaired,
            REQUESTS_WITHOUT_PARAMS,
        )

    def take_stats(self) -> KvcStats | None:
        """The scheduler side's counters since the last call, for vLLM's stats (None: nothing new)."""
        new = self._unpaired - self._unpaired_reported
        if not new:
            return None
        self._unpaired_reported = self._unpaired
        out = KvcStats()
        out.data["counters"][REQUESTS_WITHOUT_PARAMS] = new
        return out

    def _left_queue(self, rid: str) -> None:
        self._queued.pop(rid, None)
        if rid in self._renewing:
            self._renewing.discard(rid)
            self._meta.renew_stop.add(rid)

    def _start_renewals(self) -> None:
        cutoff = self._clock() - self._cfg.lease_renew_after_s
        for rid, (arrived, peer, key, p_tp) in list(self._queued.items()):
            if arrived > cutoff:
                break  # arrival order: the rest are younger
            del self._queued[rid]
            self._renewing.add(rid)
            self._meta.renew_start[rid] = (peer, key, p_tp)

    # D side ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        params = self._params_of(request)
        if params.transfer_id is not None:
            self._transfer_ids[rid] = params.transfer_id
        if rid in self._consumed or not params.remote_prefill:
            return 0, False
        if rid not in self._pending:
            self._pending[rid] = check_load(request, params, self._block_size, self._groups)
        num_prompt = len(request.prompt_token_ids or ())
        remote = self._pending[rid].remote
        count = (num_prompt if remote is None else remote.covered_tokens(num_prompt)) - num_computed_tokens
        # A bad request still goes the asynchronous way so that the worker can fail it cleanly.
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        self._left_queue(rid)
        parsed = self._pending.pop(rid, None)
        if parsed is None:
            return
        self._consumed.add(rid)
        rp = parsed.remote
        if parsed.error is not None:
            if num_external_tokens > 0:
                self._meta.reqs_failed[rid] = str(parsed.error)
            if rp is not None:
                self._release(request, rp)
            return
        assert rp is not None
        if num_external_tokens == 0:
            # Every block is a local prefix hit: nothing to read, but P must free its copy.
            self._release(request, rp)
            return
        covered = rp.covered_tokens(len(request.prompt_token_ids or ()))  # D computes any tokens after these
        first = covered - num_external_tokens  # tokens D has (prefix-cache hits): not loaded
        p_bs = rp.remote_block_size or self._block_size
        try:
            local, remote, sizes = pair_blocks(blocks, rp, first, self._block_size, self._groups)
        except TransferParamsError as e:  # a hybrid's group whose blocks P no longer holds
            logger.debug("request %s: %s", rid, e)
            self._meta.reqs_failed[rid] = str(e)
            self._release(request, rp)
            return
        arrived = getattr(request, "arrival_time", None)  # vLLM's wall-clock arrival (time.time())
        self._meta.reqs_to_recv[rid] = RecvSpec(
            peer_key=rp.peer_key,
            remote_request_id=rp.remote_request_id,
            local_block_ids=tuple(local),
            remote_block_ids=tuple(remote),
            queued_s=max(0.0, time.time() - arrived) if isinstance(arrived, (int, float)) else 0.0,
            remote_tp_size=rp.remote_tp_size,
            tokens=TokenRange(
                first, num_external_tokens, src_start=first - first % p_bs, dst_start=first - first % self._block_size
            ),
            prompt_digest=covered_digest(request, rp),
            group_sizes=sizes,
        )

    def _release(self, request: Any, rp: RemotePrefill) -> None:
        """P may free its blocks for this request (P ignores it if the digest is another prompt's)."""
        self._meta.reqs_to_recv[request.request_id] = RecvSpec(
            rp.peer_key,
            rp.remote_request_id,
            (),
            (),
            report=False,
            remote_tp_size=rp.remote_tp_size,
            prompt_digest=covered_digest(request, rp),
        )

    # P side and both -----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        if self._queued:
            self._start_renewals()
        if self._cfg.layerwise and self._transfer_ids:
            self._mark_layerwise(scheduler_output)
        meta, self._meta = self._meta, ConnectorMetadata()
        meta.idle = int(getattr(scheduler_output, "total_num_scheduled_tokens", 1) or 0) == 0
        return meta

    def _mark_layerwise(self, scheduler_output: Any) -> None:
        """Prefills (with a transfer id) that this step completes in one go: the worker may write
        each layer's blocks to a D that is already waiting, as soon as the layer is computed."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            key = self._transfer_ids.get(new.req_id)
            if key is None or new.prompt_token_ids is None:
                continue
            if new.num_computed_tokens + scheduled.get(new.req_id, 0) < len(new.prompt_token_ids):
                continue  # chunked prefill: pushed whole once the request finishes
            digest = prompt_digest(new.prompt_token_ids)
            self._meta.reqs_layerwise[new.req_id] = SendSpec(tuple(new.block_ids[0]), key, prompt_digest=digest)
            self._layerwise.add(new.req_id)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with one block list per KV cache group. A hybrid's P holds every group's blocks
        that hold KV (a sliding window's inside it) and states them group by group."""
        if not self._groups.hybrid:  # one group: its table as vLLM gives it (positions kept, nulls and all)
            return self.request_finished(request, list(block_ids[0]) if block_ids else [])
        held = self._groups.held(block_ids) if any(block_ids) else ()
        return self.request_finished(request, list(flatten(held)[0]), held)

    def request_finished(
        self, request: Any, block_ids: list[int], per_group: tuple[tuple[int, ...], ...] = ()
    ) -> tuple[bool, dict[str, Any] | None]:
        """`per_group`: a hybrid's blocks group by group (block_ids is them side by side)."""
        rid = request.request_id
        self._left_queue(rid)
        consumed = rid in self._consumed
        self._consumed.discard(rid)
        transfer_id = self._transfer_ids.pop(rid, None)
        layerwise = rid in self._layerwise
        self._layerwise.discard(rid)
        params = self._params.pop(rid, None) or parse_request_params(request.kv_transfer_params)
        parsed = self._pending.pop(rid, None)
        if parsed is None and not consumed and params.remote_prefill:
            # Aborted while still waiting: the scheduler never looked at it (e.g. behind max_num_seqs).
            parsed = check_load(request, params, self._block_size, self._groups)
        if parsed is not None and parsed.remote is not None:
            # D request finished before it was scheduled (abort): P must not hold its blocks.
            self._release(request, parsed.remote)
            return False, None
        if not params.remote_decode:
            return False, None
        key = transfer_id or rid
        if request.status not in FINISHED_NORMALLY or not block_ids:
            reason = f"prefill request {rid} ended with status {request.status}"
            if layerwise and block_ids:
                # Writes from these blocks may be in flight: hold them until they settle.
                self._meta.reqs_to_send[rid] = SendSpec(tuple(block_ids), key, cancelled=True)
                return True, None
            if transfer_id is not None:
                self._meta.transfers_cancelled[key] = reason  # a D may be waiting: fail it now
            return False, None
        digest = prompt_digest(request.prompt_token_ids) if request.prompt_token_ids is not None else None
        sizes = tuple(len(g) for g in per_group)
        self._meta.reqs_to_send[rid] = SendSpec(tuple(block_ids), key, prompt_digest=digest or "", group_sizes=sizes)
        return True, producer_params(
            block_ids=per_group or block_ids,
            engine_id=self._cfg.engine_id,
            request_id=rid,
            host=self._cfg.side_channel_host,
            port=self._port,
            num_tokens=request.num_prompt_tokens,
            transfer_id=transfer_id,
            tp_size=self._tp_size,
            block_size=self._block_size,
            digest=digest,
        )
