"""How many tokens a prompt has: exact for token ids, bounded by its bytes for text, else a D's /tokenize."""

from __future__ import annotations

import logging
from typing import Any

import anyio

from .bodies import CHAT, COMPLETIONS
from .context import ProxyContext

logger = logging.getLogger("kv_connectors.proxy")

# A text prompt of B UTF-8 bytes has at most B tokens plus the tokenizer's special ones (byte-level BPE and
# SentencePiece both cut text into pieces of at least one byte); and, in practice, at least B / 64.
SPECIAL_TOKENS = 4
MAX_BYTES_PER_TOKEN = 64
TOKENIZE_TIMEOUT_S = 5.0
# What a chat /tokenize needs of the client's body to render the same template as D will.
_CHAT_TEMPLATE_KEYS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "tools")


async def uncached_below(
    ctx: ProxyContext, route: str, body: dict[str, Any], limit: int, cached_share: float = 0.0, count: int | None = None
) -> bool:
    """Whether the part of the prompt D has not cached (`cached_share`: the estimated share it has) is
    fewer than `limit` tokens; when that cannot be told (no D answers /tokenize in time), False: the
    prompt is disaggregated as usual. `count`: the prompt's token count where already known (its ids,
    rendered for the prefix key), so it is not tokenized again."""
    left = 1.0 - cached_share
    if count is not None:
        return count * left < limit
    prompt = body.get("prompt")
    if route == COMPLETIONS and isinstance(prompt, list):
        return len(prompt) * left < limit  # token ids (one prompt of a list is its own sub-request)
    if route == COMPLETIONS and isinstance(prompt, str):
        size = len(prompt.encode())
        if size * left + SPECIAL_TOKENS < limit:
            return True
        if size * left >= limit * MAX_BYTES_PER_TOKEN:
            return False
    count = await _tokenize(ctx, route, body)
    return count is not None and count * left < limit


async def _tokenize(ctx: ProxyContext, route: str, body: dict[str, Any]) -> int | None:
    answer = await _tokenized(ctx, route, body)
    count = answer.get("count") if answer is not None else None
    if not isinstance(count, int) or isinstance(count, bool):
        return None
    return count


async def token_ids(ctx: ProxyContext, route: str, body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids as a D's /tokenize renders them (chat: with its template), or None when no D
    answers in time (what KV events name blocks by: the prefix policy can then match a text or chat prompt)."""
    answer = await _tokenized(ctx, route, body)
    ids = answer.get("tokens") if answer is not None else None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return None
    return ids


async def _tokenized(ctx: ProxyContext, route: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """A D's /tokenize answer for the prompt (a JSON object), or None."""
    backend = ctx.decode.peek()
    if backend is None:
        return None
    if route == CHAT:
        request = {"messages": body.get("messages")} | {k: body[k] for k in _CHAT_TEMPLATE_KEYS if k in body}
    else:
        request = {"prompt": body.get("prompt")}
    if "model" in body:
        request["model"] = body["model"]
    try:
        with anyio.fail_after(TOKENIZE_TIMEOUT_S):
            resp = await ctx.http().post(backend.url + "/tokenize", json=request, timeout=TOKENIZE_TIMEOUT_S)
        answer = resp.json() if resp.is_success else None
    except Exception as exc:  # noqa: BLE001 - the HTTP client's errors (some from below httpx), a body not JSON
        logger.debug("tokenize on %s failed: %r", backend.url, exc)
        return None
    if not isinstance(answer, dict):
        logger.debug("tokenize on %s answered HTTP %d without a JSON object", backend.url, resp.status_code)
        return None
    return answer
