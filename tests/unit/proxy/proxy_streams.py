"""Canned answers for the proxy's first-token tests: P's one-token answer, D's streams (completions and
chat) continuing it, a D that fails its first streams, and a reader of the events the proxy sent."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tests.unit.proxy.proxy_fakes import KV_FROM_P, ChunkStream, sse, text_chunks

LOAD_FAILED = sse({"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}})
DONE = sse("[DONE]")
PROMPT_IDS = [11, 12, 13]
KV = {**KV_FROM_P, "remote_prompt_digest": "0" * 32}


def failing_first(times: int, failed: list[bytes], good: list[bytes] | None = None) -> Callable[[], ChunkStream]:
    """A D stream factory: its first `times` streams send `failed`, the others `good`."""
    calls = {"n": 0}

    def make() -> ChunkStream:
        calls["n"] += 1
        return ChunkStream(failed if calls["n"] <= times else (good or text_chunks(["a", "b"])))

    return make


def p_answer(route: str, text: str = "Hel", finish: str = "length", token: int = 50) -> Any:
    def answer(body: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"id": "cmpl-p", "created": 7, "model": "m", "kv_transfer_params": KV}
        if route == "chat":
            out["prompt_token_ids"] = PROMPT_IDS
            out["choices"] = [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "token_ids": [token]}
            ]
        else:
            out["choices"] = [
                {"index": 0, "text": text, "finish_reason": finish, "prompt_token_ids": PROMPT_IDS, "token_ids": [token]}
            ]
        out["usage"] = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        return out

    return answer


def d_completion_chunks() -> list[bytes]:
    return [
        sse(
            {
                "id": "cmpl-d",
                "object": "text_completion",
                "created": 8,
                "model": "m",
                "choices": [
                    {"index": 0, "text": "lo", "prompt_token_ids": PROMPT_IDS + [50], "token_ids": [51], "finish_reason": None}
                ],
            }
        ),
        sse(
            {
                "id": "cmpl-d",
                "object": "text_completion",
                "created": 8,
                "model": "m",
                "choices": [{"index": 0, "text": "!", "token_ids": [52], "finish_reason": "length"}],
            }
        ),
        sse(
            {
                "id": "cmpl-d",
                "object": "text_completion",
                "created": 8,
                "model": "m",
                "choices": [],
                "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
            }
        ),
        DONE,
    ]


def d_chat_chunks() -> list[bytes]:
    head = {"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 8, "model": "m"}
    return [
        sse(
            {
                **head,
                "prompt_token_ids": PROMPT_IDS + [50],
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
        ),
        sse({**head, "choices": [{"index": 0, "delta": {"content": "lo"}, "token_ids": [51], "finish_reason": None}]}),
        sse({**head, "choices": [{"index": 0, "delta": {"content": "!"}, "token_ids": [52], "finish_reason": "length"}]}),
        sse({**head, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}),
        DONE,
    ]


def events(content: bytes) -> list[Any]:
    out = []
    for block in content.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out
