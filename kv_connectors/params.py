"""vLLM's per-request kv_transfer_params: what P returns and D receives, parsed into typed values."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kv_connectors.errors import TransferParamsError

_REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
_REQUIRED_TRANSFER_ID = ("transfer_id", "remote_host", "remote_port")


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

    @property
    def peer_key(self) -> tuple[str, str, int]:
        return (self.remote_engine_id, self.remote_host, self.remote_port)

    @property
    def push_only(self) -> bool:
        """P's blocks are unknown: only P can move them (it writes into ours)."""
        return not self.remote_block_ids


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    return params is not None and bool(params) and params.get("do_remote_prefill") is True


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    return params is not None and bool(params) and params.get("do_remote_decode") is True


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TransferParamsError(f"kv_transfer_params[{name!r}] must be an integer >= {minimum}, got {value!r}")
    return value


def _port(value: Any) -> int:
    port = _int("remote_port", value, 1)
    if port > 65535:
        raise TransferParamsError(f"kv_transfer_params['remote_port'] must be a port in 1..65535, got {value!r}")
    return port


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TransferParamsError(f"kv_transfer_params[{name!r}] must be a non-empty string, got {value!r}")
    return value


def parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """Validate a D request's params; raise TransferParamsError naming the first bad field."""
    if not isinstance(params, Mapping):
        raise TransferParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    if params.get("remote_block_ids") is None and params.get("transfer_id") is not None:
        return _parse_transfer_id_form(params)
    missing = [k for k in _REQUIRED if params.get(k) is None]
    if missing:
        raise TransferParamsError(
            f"kv_transfer_params with do_remote_prefill lacks {', '.join(missing)} "
            "(copy the prefill server's kv_transfer_params into the decode request)"
        )
    ids = params["remote_block_ids"]
    if not isinstance(ids, list) or not ids:
        raise TransferParamsError(f"kv_transfer_params['remote_block_ids'] must be a non-empty list, got {ids!r}")
    block_ids = tuple(_int("remote_block_ids[]", b, 0) for b in ids)
    num_tokens = params.get("remote_num_tokens")
    return RemotePrefill(
        remote_block_ids=block_ids,
        remote_engine_id=_str("remote_engine_id", params["remote_engine_id"]),
        remote_request_id=_str("remote_request_id", params["remote_request_id"]),
        remote_host=_str("remote_host", params["remote_host"]),
        remote_port=_port(params["remote_port"]),
        remote_num_tokens=None if num_tokens is None else _int("remote_num_tokens", num_tokens, 1),
        transfer_id=None if params.get("transfer_id") is None else _str("transfer_id", params["transfer_id"]),
    )


def _parse_transfer_id_form(params: Mapping[str, Any]) -> RemotePrefill:
    missing = [k for k in _REQUIRED_TRANSFER_ID if params.get(k) is None]
    if missing:
        raise TransferParamsError(
            f"kv_transfer_params with do_remote_prefill and transfer_id lacks {', '.join(missing)} "
            "(the prefill server's side-channel host and port)"
        )
    engine = params.get("remote_engine_id")
    transfer_id = _str("transfer_id", params["transfer_id"])
    return RemotePrefill(
        remote_block_ids=(),
        remote_engine_id="" if engine is None else _str("remote_engine_id", engine),
        remote_request_id=transfer_id,
        remote_host=_str("remote_host", params["remote_host"]),
        remote_port=_port(params["remote_port"]),
        remote_num_tokens=None,
        transfer_id=transfer_id,
    )


def release_address(params: Any) -> RemotePrefill | None:
    """Where to tell P to free its blocks when the params are otherwise bad (block ids, counts):
    P's side channel and key, if those are usable; None if not (P's lease frees the blocks)."""
    if not isinstance(params, Mapping):
        return None
    key = params.get("remote_request_id", params.get("transfer_id"))
    try:
        return RemotePrefill(
            remote_block_ids=(),
            remote_engine_id="" if params.get("remote_engine_id") is None else _str("remote_engine_id", params["remote_engine_id"]),
            remote_request_id=_str("remote_request_id", key),
            remote_host=_str("remote_host", params.get("remote_host")),
            remote_port=_port(params.get("remote_port")),
            remote_num_tokens=None,
        )
    except TransferParamsError:
        return None


def producer_transfer_id(params: Mapping[str, Any] | None) -> str | None:
    """P side: the transfer id a prefill request was sent with (transfer-id flow), if any."""
    if not params or params.get("transfer_id") is None:
        return None
    return _str("transfer_id", params["transfer_id"])


def producer_params(
    *,
    block_ids: list[int],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    num_tokens: int,
    transfer_id: str | None = None,
) -> dict[str, Any]:
    """What P returns with its answer, for the proxy to copy into D's request.

    remote_request_id is the key P holds the blocks under: the transfer id when the request
    came with one, so that both flows find them."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(block_ids),
        "remote_engine_id": engine_id,
        "remote_request_id": transfer_id or request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
        "tp_size": 1,
    }
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    return params
