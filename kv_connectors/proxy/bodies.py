"""Request bodies: validation, the P and D bodies of each flow, list-of-prompts split, and merged answers."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from .config import SideChannel
from .errors import bad_request
from .prefix import PromptKey, prompt_key
from .sse import split_events

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ROUTES = (COMPLETIONS, CHAT)

# What P gets in the params (NIXL) flow; P answers with the kv_transfer_params D needs.
PREFILL_KV_PARAMS: Mapping[str, Any] = MappingProxyType(
    {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)
_P_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) and t >= 0 for t in value)


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt):
            return
    raise bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids (non-negative integers) or a list of token-id lists"
    )


def _check_positive_int(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and not (_is_int(value) and value >= 1):
        raise bad_request(f"'{name}' must be a positive integer, got {value!r}")


def validate(route: str, body: dict[str, Any]) -> None:
    """Raise a 400 ProxyError naming the first bad field; vLLM validates everything else."""
    if route == COMPLETIONS:
        if "prompt" not in body:
            raise bad_request("missing required field 'prompt'")
        _check_prompt(body["prompt"])
    else:
        messages = body.get("messages")
        if messages is None:
            raise bad_request("missing required field 'messages'")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("'messages' must be a non-empty list of message objects")
    _check_positive_int(body, "max_tokens")
    _check_positive_int(body, "max_completion_tokens")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"'stream' must be a boolean, got {stream!r}")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n < 1):
        raise bad_request(f"'n' must be a positive integer, got {n!r}")
    if n is not None and n > 1:
        raise bad_request("'n' > 1 is not supported by the PD proxy; send n separate requests")


def is_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True


def split_prompts(route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """One body per prompt of a completions list-of-prompts (so prompts never share P/D blocks)."""
    prompt = body.get("prompt")
    if route != COMPLETIONS or not isinstance(prompt, list) or _is_token_ids(prompt):
        return [body]
    return [{**body, "prompt": p} for p in prompt]


def prefix_key(route: str, body: dict[str, Any], chunk_tokens: int) -> PromptKey:
    """One prompt's key for the prefix policy: completions' text or token ids, chat's messages."""
    if route == CHAT:
        messages = body.get("messages")
        return prompt_key(None, messages if isinstance(messages, list) else [], chunk_tokens)
    prompt = body.get("prompt")
    return prompt_key(prompt if isinstance(prompt, str) or _is_token_ids(prompt) else None, None, chunk_tokens)


def wants_token_forwarding(route: str, body: dict[str, Any]) -> bool:
    """Whether D can be given P's prompt token ids instead of the text (vLLM 0.32: completions prompt as ids,
    chat `kv_transfer_params.prompt_token_ids`). Not with echo (D must render the client's own prompt) nor
    a completions suffix (vLLM takes it with a text prompt only)."""
    if body.get("echo") or body.get("suffix"):
        return False
    return route == CHAT or isinstance(body.get("prompt"), str)


def prefill_body(body: dict[str, Any], kv_params: dict[str, Any], return_token_ids: bool) -> dict[str, Any]:
    """The P request: one token, no streaming, KV kept for a remote decode."""
    p_body = {k: v for k, v in body.items() if k not in _P_DROPPED}
    p_body["kv_transfer_params"] = kv_params
    p_body["stream"] = False
    p_body["max_tokens"] = 1
    if "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    if return_token_ids:
        p_body["return_token_ids"] = True
    return p_body


def prompt_token_ids(route: str, answer: dict[str, Any]) -> list[int] | None:
    """The prompt token ids in P's answer to a return_token_ids request (None if absent)."""
    if route == CHAT:
        ids = answer.get("prompt_token_ids")
    else:
        choices = answer.get("choices")
        ids = choices[0].get("prompt_token_ids") if isinstance(choices, list) and choices else None
    return ids if _is_token_ids(ids) else None


def decode_only_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body without any kv_transfer_params of the client's: D computing the prompt itself, and
    what every other D body starts from."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def decode_body_params(
    route: str, body: dict[str, Any], kv_params: dict[str, Any] | None, token_ids: list[int] | None
) -> dict[str, Any]:
    """The D request of the params flow: the client's body plus P's kv_transfer_params (and token ids)."""
    d_body = decode_only_body(body)
    if kv_params is not None:
        d_body["kv_transfer_params"] = dict(kv_params)
    if token_ids is not None:
        if route == COMPLETIONS:
            d_body["prompt"] = token_ids
        elif kv_params is not None:
            d_body["kv_transfer_params"]["prompt_token_ids"] = token_ids
    return d_body


def transfer_prefill_params(transfer_id: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def transfer_decode_body(body: dict[str, Any], transfer_id: str, side_channel: SideChannel) -> dict[str, Any]:
    """The D request of the transfer-id flow: the client's body addressed to P's side channel."""
    d_body = decode_only_body(body)
    d_body["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_host": side_channel.host,
        "remote_port": side_channel.port,
    }
    return d_body


def _sum_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    if not usages:
        return None
    total: dict[str, Any] = {}
    for usage in usages:
        for key, value in usage.items():
            if _is_int(value):
                total[key] = total.get(key, 0) + value
    return total


def merge_answers(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-prompt D answers -> one completions answer, choices re-indexed in prompt order."""
    merged = {k: v for k, v in answers[0].items() if k not in ("choices", "usage", "kv_transfer_params")}
    choices: list[Any] = []
    for index, answer in enumerate(answers):
        for choice in answer.get("choices") or []:
            choices.append({**choice, "index": index})
    merged["choices"] = choices
    usage = _sum_usage([a["usage"] for a in answers if isinstance(a.get("usage"), dict)])
    if usage is not None:
        merged["usage"] = usage
    return merged


class SseReindexer:
    """Rewrites one sub-stream's SSE events for a merged stream: choice index set, [DONE] and usage held back."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._buffer = b""
        self.usage: dict[str, Any] | None = None
        self.usage_chunk: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> list[bytes]:
        events, self._buffer = split_events(self._buffer + chunk)
        return [out for event in events if (out := self._event(event)) is not None]

    def flush(self) -> list[bytes]:
        rest, self._buffer = self._buffer, b""
        out = self._event(rest) if rest.strip() else None
        return [out] if out is not None else []

    def _event(self, event: bytes) -> bytes | None:
        data = event.strip()
        if not data.startswith(b"data:"):
            return event + b"\n\n" if data else None
        payload = data[5:].strip()
        if payload == b"[DONE]":
            return None
        try:
            obj = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
            return event + b"\n\n"  # an error event or something we do not know: as is
        if not obj["choices"] and isinstance(obj.get("usage"), dict):
            self.usage, self.usage_chunk = obj["usage"], obj
            return None
        obj["choices"] = [{**c, "index": self.index} if isinstance(c, dict) else c for c in obj["choices"]]
        return b"data: " + json.dumps(obj).encode() + b"\n\n"


def merged_usage_event(reindexers: Sequence[SseReindexer]) -> bytes:
    """The one usage-only chunk of a merged stream (empty when no sub-stream sent usage)."""
    held = [r for r in reindexers if r.usage_chunk is not None]
    if not held:
        return b""
    chunk = dict(held[0].usage_chunk or {})
    chunk["usage"] = _sum_usage([r.usage for r in held if r.usage is not None])
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"
