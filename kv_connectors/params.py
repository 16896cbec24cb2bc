"""vLLM's per-request kv_transfer_params: what P returns and D receives, parsed into typed values."""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from kv_connectors.errors import TransferParamsError
from kv_connectors.groups import MAX_GROUPS
from kv_connectors.specs import ProducerAddress

# The keys of kv_transfer_params (vLLM's, and the transfer id of Mooncake-style proxies): spelled here only.
DO_REMOTE_PREFILL = "do_remote_prefill"  # D: load the prompt's KV from a producer
DO_REMOTE_DECODE = "do_remote_decode"  # P: keep the prompt's KV for a consumer
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_REQUEST_ID = "remote_request_id"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_NUM_TOKENS = "remote_num_tokens"
TRANSFER_ID = "transfer_id"
TP_SIZE = "tp_size"
REMOTE_BLOCK_SIZE = "remote_block_size"  # P's tokens per block (D's may differ: planned token by token)
# A digest of P's prompt token ids: D checks its own prompt's first remote_num_tokens tokens against it
# (a D request for another prompt fails instead of decoding from that prompt's KV), and may then carry
# more tokens than P's prompt (the first token from prefill: D computes what P's KV does not cover).
REMOTE_PROMPT_DIGEST = "remote_prompt_digest"
# Keys the built-in NixlConnector's P states too, which routers and frameworks in NIXL mode may read
# (tests/unit/vllm/test_params_shape.py): P's decode-context and pipeline parallel sizes (ours: 1, pipeline
# parallel is refused at start-up), the transfer mode and the deadline of blocks a D holds for readback
# (None on a P's answer). The mode is always "pull": our P's answer holds the blocks for D and names
# them, and D's config decides who moves the bytes; vllm-router reads "push" as the built-in push
# connector's flow and then sends D no block ids (seen with 0.1.17).
DCP_SIZE = "dcp_size"
PP_SIZE = "pp_size"
TRANSFER_MODE = "transfer_mode"
REMOTE_BLOCKS_EXPIRY_TIME = "remote_blocks_expiry_time"

_REQUIRED = (REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID, REMOTE_REQUEST_ID, REMOTE_HOST, REMOTE_PORT)
_REQUIRED_TRANSFER_ID = (TRANSFER_ID, REMOTE_HOST, REMOTE_PORT)


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """D's view of a prefill done elsewhere: where P holds (or will hold) the prompt's blocks.

    Two forms. After P answered (the "params" flow): P's block ids and request id. Sent to P
    and D at once (the "transfer-id" flow): only P's side channel and a transfer id both
    requests carry; P's blocks are unknown, so P pushes into D's blocks when it has them.
    """

    remote_block_ids: tuple[int, ...]  # empty in the transfer-id flow
    remote_engine_id: str  # "" when the proxy did not name P's engine: any engine is accepted
    remote_request_id: str  # the key P holds the blocks under: its request id, or the transfer id
    remote_host: str
    remote_port: int
    remote_num_tokens: int | None
    transfer_id: str | None = None
    # P's tensor-parallel size when the params state it (P's rank 0 at remote_port names the others'
    # ports); None in the transfer-id flow: the handshake with each rank checks it then.
    remote_tp_size: int | None = None
    remote_block_size: int | None = None  # P's tokens per block, when the params state it
    remote_prompt_digest: str | None = None  # prompt_digest of P's prompt, when the params state it
    # A hybrid model's P states one block list per KV cache group: remote_block_ids is them side by
    # side (groups.flatten), these their lengths; () for one group.
    remote_group_sizes: tuple[int, ...] = ()

    def covered_tokens(self, num_prompt: int) -> int:
        """How many of D's `num_prompt` prompt tokens P's KV covers (all when P did not say)."""
        return num_prompt if self.remote_num_tokens is None else min(num_prompt, self.remote_num_tokens)

    @property
    def peer_key(self) -> ProducerAddress:
        return ProducerAddress(self.remote_engine_id, self.remote_host, self.remote_port)

    @property
    def push_only(self) -> bool:
        """P's blocks are unknown: only P can move them (it writes into ours)."""
        return not self.remote_block_ids


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A 128-bit digest of a prompt's token ids (what P states, what D checks)."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


def _digest(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 32 or any(c not in "0123456789abcdef" for c in value):
        raise TransferParamsError(f"kv_transfer_params[{REMOTE_PROMPT_DIGEST!r}] must be 32 lowercase hex digits, got {value!r}")
    return value


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    return isinstance(params, Mapping) and params.get(DO_REMOTE_PREFILL) is True


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    return isinstance(params, Mapping) and params.get(DO_REMOTE_DECODE) is True


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TransferParamsError(f"kv_transfer_params[{name!r}] must be an integer >= {minimum}, got {value!r}")
    return value


def _port(value: Any) -> int:
    port = _int(REMOTE_PORT, value, 1)
    if port > 65535:
        raise TransferParamsError(f"kv_transfer_params[{REMOTE_PORT!r}] must be a port in 1..65535, got {value!r}")
    return port


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TransferParamsError(f"kv_transfer_params[{name!r}] must be a non-empty string, got {value!r}")
    return value


def parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """Validate a D request's params; raise TransferParamsError naming the first bad field."""
    if not isinstance(params, Mapping):
        raise TransferParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    if params.get(REMOTE_BLOCK_IDS) is None and params.get(TRANSFER_ID) is not None:
        return _parse_transfer_id_form(params)
    missing = [k for k in _REQUIRED if params.get(k) is None]
    if missing:
        raise TransferParamsError(
            f"kv_transfer_params with {DO_REMOTE_PREFILL} lacks {', '.join(missing)} "
            "(copy the prefill server's kv_transfer_params into the decode request)"
        )
    block_ids, group_sizes = _block_ids(params[REMOTE_BLOCK_IDS])
    num_tokens = params.get(REMOTE_NUM_TOKENS)
    return RemotePrefill(
        remote_block_ids=block_ids,
        remote_group_sizes=group_sizes,
        remote_engine_id=_str(REMOTE_ENGINE_ID, params[REMOTE_ENGINE_ID]),
        remote_request_id=_str(REMOTE_REQUEST_ID, params[REMOTE_REQUEST_ID]),
        remote_host=_str(REMOTE_HOST, params[REMOTE_HOST]),
        remote_port=_port(params[REMOTE_PORT]),
        remote_num_tokens=None if num_tokens is None else _int(REMOTE_NUM_TOKENS, num_tokens, 1),
        transfer_id=None if params.get(TRANSFER_ID) is None else _str(TRANSFER_ID, params[TRANSFER_ID]),
        remote_tp_size=_tp_size(params),
        remote_block_size=None if params.get(REMOTE_BLOCK_SIZE) is None else _int(REMOTE_BLOCK_SIZE, params[REMOTE_BLOCK_SIZE], 1),
        remote_prompt_digest=_digest(params.get(REMOTE_PROMPT_DIGEST)),
    )


def _block_ids(ids: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """P's block ids: one list (one KV cache group), or one list per group (the built-in's shape, which a
    single group also takes): (the ids side by side, each group's count; () for one group)."""
    name = REMOTE_BLOCK_IDS
    if isinstance(ids, list) and ids and all(isinstance(g, list) for g in ids):
        if len(ids) > MAX_GROUPS:
            raise TransferParamsError(f"kv_transfer_params[{name!r}] names {len(ids)} KV cache groups, at most {MAX_GROUPS}")
        if len(ids) > 1:
            flat = tuple(_int(f"{name}[][]", b, 0) for g in ids for b in g)
            if not flat:
                raise TransferParamsError(f"kv_transfer_params[{name!r}] must name a block, got {ids!r}")
            return flat, tuple(len(g) for g in ids)
        ids = ids[0]
    if not isinstance(ids, list) or not ids:
        raise TransferParamsError(f"kv_transfer_params[{name!r}] must be a non-empty list, got {ids!r}")
    return tuple(_int(f"{name}[]", b, 0) for b in ids), ()


def _tp_size(params: Mapping[str, Any]) -> int | None:
    """P's tensor-parallel size, if the params state it."""
    value = params.get(TP_SIZE)
    return None if value is None else _int(TP_SIZE, value, 1)


def _parse_transfer_id_form(params: Mapping[str, Any]) -> RemotePrefill:
    missing = [k for k in _REQUIRED_TRANSFER_ID if params.get(k) is None]
    if missing:
        raise TransferParamsError(
            f"kv_transfer_params with {DO_REMOTE_PREFILL} and {TRANSFER_ID} lacks {', '.join(missing)} "
            "(the prefill server's side-channel host and port)"
        )
    engine = params.get(REMOTE_ENGINE_ID)
    transfer_id = _str(TRANSFER_ID, params[TRANSFER_ID])
    return RemotePrefill(
        remote_block_ids=(),
        remote_engine_id="" if engine is None else _str(REMOTE_ENGINE_ID, engine),
        remote_request_id=transfer_id,
        remote_host=_str(REMOTE_HOST, params[REMOTE_HOST]),
        remote_port=_port(params[REMOTE_PORT]),
        remote_num_tokens=None,
        transfer_id=transfer_id,
        remote_tp_size=_tp_size(params),
    )


def release_address(params: Any) -> RemotePrefill | None:
    """Where to tell P to free its blocks when the params are otherwise bad (block ids, counts):
    P's side channel and key, if those are usable; None if not (P's lease frees the blocks)."""
    if not isinstance(params, Mapping):
        return None
    key = params.get(REMOTE_REQUEST_ID, params.get(TRANSFER_ID))
    engine = params.get(REMOTE_ENGINE_ID)
    try:
        return RemotePrefill(
            remote_block_ids=(),
            remote_engine_id="" if engine is None else _str(REMOTE_ENGINE_ID, engine),
            remote_request_id=_str(REMOTE_REQUEST_ID, key),
            remote_host=_str(REMOTE_HOST, params.get(REMOTE_HOST)),
            remote_port=_port(params.get(REMOTE_PORT)),
            remote_num_tokens=None,
        )
    except TransferParamsError:
        return None


def producer_transfer_id(params: Mapping[str, Any] | None) -> str | None:
    """P side: the transfer id a prefill request was sent with (transfer-id flow), if any."""
    if not params or params.get(TRANSFER_ID) is None:
        return None
    return _str(TRANSFER_ID, params[TRANSFER_ID])


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's kv_transfer_params, parsed once (what the scheduler side decides by).

    Bad values never raise here: they are kept as the error, for the scheduler to fail (D) or
    warn about (P) the request when it looks at it."""

    remote_prefill: bool = False  # D: the request loads its prompt's KV from a producer
    remote_decode: bool = False  # P: the request's prompt KV is kept for a consumer
    prefill: RemotePrefill | None = None  # D: where P holds the KV (None when the params are bad)
    prefill_error: TransferParamsError | None = None  # D: what is wrong with them
    # D, bad params: P's side channel and key, if still usable, so that P can be told to free its blocks.
    release: RemotePrefill | None = None
    transfer_id: str | None = None  # P: the transfer id the request came with (transfer-id flow)
    transfer_id_error: TransferParamsError | None = None  # P: a transfer id that is not a string


NO_PARAMS = RequestParams()  # a request without kv_transfer_params: no transfer either way


def parse_request_params(params: Any) -> RequestParams:
    """Parse a request's kv_transfer_params once; never raises."""
    if not isinstance(params, Mapping) or not params:
        return NO_PARAMS
    prefill = release = None
    prefill_error = transfer_id_error = None
    transfer_id = None
    remote_prefill, remote_decode = wants_remote_prefill(params), wants_remote_decode(params)
    if remote_prefill:
        try:
            prefill = parse_remote_prefill(params)
        except TransferParamsError as e:
            prefill_error, release = e, release_address(params)
    if remote_decode:
        try:
            transfer_id = producer_transfer_id(params)
        except TransferParamsError as e:
            transfer_id_error = e
    return RequestParams(remote_prefill, remote_decode, prefill, prefill_error, release, transfer_id, transfer_id_error)


def producer_params(
    *,
    block_ids: Sequence[int] | Sequence[Sequence[int]],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    num_tokens: int,
    transfer_id: str | None = None,
    tp_size: int = 1,
    block_size: int | None = None,
    digest: str | None = None,
) -> dict[str, Any]:
    """What P returns with its answer, for the proxy to copy into D's request.

    remote_request_id is the key P holds the blocks under: the transfer id when the request
    came with one, so that both flows find them."""
    params = {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        REMOTE_BLOCK_IDS: [list(g) if isinstance(g, Sequence) else g for g in block_ids],  # one list per group: hybrids
        REMOTE_ENGINE_ID: engine_id,
        REMOTE_REQUEST_ID: transfer_id or request_id,
        REMOTE_HOST: host,
        REMOTE_PORT: port,
        REMOTE_NUM_TOKENS: num_tokens,
        TP_SIZE: tp_size,
        DCP_SIZE: 1,
        PP_SIZE: 1,
        TRANSFER_MODE: "pull",
        REMOTE_BLOCKS_EXPIRY_TIME: None,
    }
    if block_size is not None:
        params[REMOTE_BLOCK_SIZE] = block_size
    if digest is not None:  # prompt_digest of P's prompt token ids
        params[REMOTE_PROMPT_DIGEST] = digest
    if transfer_id is not None:
        params[TRANSFER_ID] = transfer_id
    return params
