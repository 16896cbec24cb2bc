"""vLLM's per-request kv_transfer_params: what P returns and D receives, parsed into typed values."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kv_connectors.errors import TransferParamsError

_REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """D's view of a prefill done elsewhere: where P holds the prompt's blocks."""

    remote_block_ids: tuple[int, ...]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_num_tokens: int | None

    @property
    def peer_key(self) -> tuple[str, str, int]:
        return (self.remote_engine_id, self.remote_host, self.remote_port)


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    return bool(params) and params.get("do_remote_prefill") is True


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    return bool(params) and params.get("do_remote_decode") is True


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TransferParamsError(f"kv_transfer_params[{name!r}] must be an integer >= {minimum}, got {value!r}")
    return value


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TransferParamsError(f"kv_transfer_params[{name!r}] must be a non-empty string, got {value!r}")
    return value


def parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """Validate a D request's params; raise TransferParamsError naming the first bad field."""
    if not isinstance(params, Mapping):
        raise TransferParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
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
        remote_port=_int("remote_port", params["remote_port"], 1),
        remote_num_tokens=None if num_tokens is None else _int("remote_num_tokens", num_tokens, 1),
    )


def producer_params(
    *,
    block_ids: list[int],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    num_tokens: int,
) -> dict[str, Any]:
    """What P returns with its answer, for the proxy to copy into D's request."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(block_ids),
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
        "tp_size": 1,
    }
