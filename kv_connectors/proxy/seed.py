"""First token from prefill: P's sampled token goes to the client at once, D continues from prompt + that token.

P already samples the first token of every disaggregated request. For a streamed request the proxy sends it
to the client as soon as P answers, and asks D to continue from P's prompt token ids plus that token (D loads
P's KV for the prompt, which P's `remote_prompt_digest` lets D check, and computes only the one new position),
so the client's time to first token no longer includes the KV transfer and D's scheduling. D's events are
then rewritten so that the client gets what one server would have sent: D's own preamble and prompt token
ids dropped, usage counted against the client's prompt, one response id.

Only where the result is exact: requests whose every option acts per token (no stop strings, no
presence/frequency penalties, no prompt logprobs, no tools or structured output, no echo, no per-chunk usage;
logprobs are P's for the first token, D's after it, completions' text offsets moved past the first token), and
answers where P stopped because of max_tokens=1 with a first token that is whole text (not part of a
multi-byte character, not empty). Anything else takes the usual flow (D generates from the first token)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .bodies import CHAT, COMPLETIONS, decode_only_body
from .sse import EventKind, parse_event, split_events

# Request fields whose presence (with a value other than these) rules seeding out.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False, None),
    "prompt_logprobs": (None,),
    "stop": (None, "", []),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "use_beam_search": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "continue_final_message": (None, False),
    # D would truncate prompt + first token again (dropping context or the token itself).
    "truncate_prompt_tokens": (None,),
    # D's random generator starts afresh (token 2 drawn as P drew token 1); bad words are matched against
    # output tokens only, and P's token is in D's prompt.
    "seed": (None,),
    "bad_words": (None, []),
}
# Completions' max_tokens when the request gives none (or null), as vLLM 0.32 reads it.
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def request_seedable(route: str, body: dict[str, Any]) -> bool:
    """Whether a (single-prompt, streamed) request's options all act token by token, so that P's first
    token and D's continuation are what one server would generate."""
    if route not in (COMPLETIONS, CHAT) or body.get("stream") is not True:
        return False
    for name, neutral in _NEUTRAL.items():
        if name in body and not any(type(body[name]) is type(n) and body[name] == n for n in neutral):
            return False  # by type too: completions' logprobs=0 (the sampled token's) is not False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return False
    limit = output_limit(route, body)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 2):
        return False  # P's token is the whole answer: the usual flow also frees P's blocks
    if route == CHAT:
        return not _has_non_text_content(body.get("messages"))  # vLLM renders those, ignoring forwarded ids
    prompt = body.get("prompt")
    return isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))


def output_limit(route: str, body: dict[str, Any]) -> Any:
    """The most tokens the request may generate, as vLLM 0.32 reads it (None: up to the context length):
    completions' max_tokens (16 when absent or null; max_completion_tokens is not a completions field),
    chat's max_completion_tokens unless null, else its max_tokens."""
    if route == COMPLETIONS:
        limit = body.get("max_tokens")
        return _COMPLETIONS_DEFAULT_MAX_TOKENS if limit is None else limit
    limit = body.get("max_completion_tokens")
    return body.get("max_tokens") if limit is None else limit


def _has_non_text_content(messages: Any) -> bool:
    """A message's content has a part other than plain text (an image, audio, ...)."""
    if not isinstance(messages, list):
        return True
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            return True
        if any(
            not isinstance(part, dict) or part.get("type", "text") != "text" or set(part) - {"type", "text"} for part in content
        ):
            return True
    return False


@dataclass(frozen=True)
class FirstToken:
    """What P's answer says of the first token, and what the client's stream is built from."""

    token_id: int
    text: str
    prompt_token_ids: list[int]
    response_id: str
    created: Any
    model: Any
    logprobs: Any = None  # P's logprobs of the first token, when the request asked for them

    @property
    def text_offset_shift(self) -> int:
        """Where D's completions text offsets start: past the first token's (as vLLM counts: its token string)."""
        tokens = self.logprobs.get("tokens") if isinstance(self.logprobs, dict) else None
        return len(tokens[0]) if isinstance(tokens, list) and tokens and isinstance(tokens[0], str) else 0


def first_token(route: str, answer: dict[str, Any]) -> FirstToken | None:
    """P's first token, when it can seed D: P stopped at max_tokens (not at EOS or a stop token), the token
    ids are there, and the token's text is whole (a piece of a multi-byte character is held back by vLLM
    and ends as "" or U+FFFD). None: take the usual flow."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if choice.get("finish_reason") != "length":
        return None
    token_ids = choice.get("token_ids")
    if route == CHAT:
        prompt_ids = answer.get("prompt_token_ids")
        message = choice.get("message")
        if (
            not isinstance(message, dict)
            or message.get("tool_calls")
            or message.get("reasoning")
            or message.get("reasoning_content")
        ):
            return None
        text = message.get("content")
    else:
        prompt_ids = choice.get("prompt_token_ids")
        text = choice.get("text")
    if not (isinstance(token_ids, list) and len(token_ids) == 1 and isinstance(token_ids[0], int)):
        return None
    if not (isinstance(prompt_ids, list) and prompt_ids and all(isinstance(t, int) for t in prompt_ids)):
        return None
    if not isinstance(text, str) or not text or "\ufffd" in text:
        return None
    return FirstToken(
        token_ids[0],
        text,
        list(prompt_ids),
        str(answer.get("id", "")),
        answer.get("created"),
        answer.get("model"),
        choice.get("logprobs"),
    )


# What our P states with its kv_transfer_params, and what our D checks a longer prompt against. Without it
# (another connector) D may not take a prompt longer than P's: vLLM 0.32's built-in NixlConnector kills its
# engine on one (an assertion on the block counts), so such a P never seeds.
PROMPT_DIGEST_KEY = "remote_prompt_digest"


def prefill_can_seed(kv_params: dict[str, Any] | None) -> bool:
    """Whether P's kv_transfer_params let D continue from a prompt longer than P's (our connector's)."""
    return isinstance(kv_params, dict) and isinstance(kv_params.get(PROMPT_DIGEST_KEY), str)


def decide(route: str, answer: dict[str, Any], kv_params: dict[str, Any] | None) -> tuple[FirstToken | None, str]:
    """P's first token when it can seed D, and the result to count (kvc_proxy_first_token_total)."""
    if not prefill_can_seed(kv_params):
        return None, "no_prompt_digest"
    first = first_token(route, answer)
    return first, "seeded" if first is not None else "answer_not_seedable"


def _minus_one(body: dict[str, Any], name: str, floor: int) -> None:
    value = body.get(name)
    if isinstance(value, int) and not isinstance(value, bool):
        body[name] = max(floor, value - 1)


def continue_body(route: str, body: dict[str, Any], kv_params: dict[str, Any] | None, first: FirstToken) -> dict[str, Any]:
    """D's request: the client's, from prompt + the first token, one token fewer to generate; with P's
    kv_transfer_params (None: D computes the prompt itself, e.g. a retry after P's KV was lost)."""
    d_body = decode_only_body(body)
    ids = [*first.prompt_token_ids, first.token_id]
    if route == COMPLETIONS:
        d_body["max_tokens"] = output_limit(route, body)  # stated: D's default would be another 16
    for name in ("max_tokens", "max_completion_tokens"):
        _minus_one(d_body, name, 1)
    _minus_one(d_body, "min_tokens", 0)
    if route == COMPLETIONS:
        d_body["prompt"] = ids
        if kv_params is not None:
            d_body["kv_transfer_params"] = dict(kv_params)
    else:
        d_body["kv_transfer_params"] = {**(kv_params or {}), "prompt_token_ids": ids}
    return d_body


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def first_events(route: str, body: dict[str, Any], first: FirstToken) -> bytes:
    """The client's first SSE events, as one server would have sent them for the first token."""
    ids_asked = body.get("return_token_ids") is True
    head = {"id": first.response_id, "created": first.created, "model": first.model}
    if route == COMPLETIONS:
        choice: dict[str, Any] = {
            "index": 0,
            "text": first.text,
            "logprobs": first.logprobs,
            "finish_reason": None,
            "stop_reason": None,
        }
        if ids_asked:
            choice |= {"prompt_token_ids": first.prompt_token_ids, "token_ids": [first.token_id]}
        return _event({**head, "object": "text_completion", "choices": [choice]})
    role = {**head, "object": "chat.completion.chunk"}
    role["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
    if ids_asked:
        role["prompt_token_ids"] = first.prompt_token_ids
    content: dict[str, Any] = {"index": 0, "delta": {"content": first.text}, "logprobs": first.logprobs, "finish_reason": None}
    if ids_asked:
        content["token_ids"] = [first.token_id]
    return _event(role) + _event({**head, "object": "chat.completion.chunk", "choices": [content]})


class ContinuationRewriter:
    """D's stream, as the rest of the client's: D's preamble (chat's role chunk) and its prompt token ids
    dropped, the response id made the first token's, usage counted against the client's prompt (one prompt
    token fewer, one completion token more)."""

    def __init__(self, first: FirstToken) -> None:
        self.first = first
        self._rest = b""

    def feed(self, chunk: bytes) -> bytes:
        events, self._rest = split_events(self._rest + chunk)
        return b"".join(self._rewrite(e) for e in events)

    def flush(self) -> bytes:
        rest, self._rest = self._rest, b""
        return self._rewrite(rest) if rest.strip() else b""

    def _rewrite(self, event: bytes) -> bytes:
        kind, obj = parse_event(event)
        if kind is EventKind.PREAMBLE and obj is not None:
            return b""  # D's role chunk: the client had it with the first token
        if kind is not EventKind.OUTPUT or not isinstance(obj, dict):
            return event + b"\n\n"  # comments, [DONE], errors, what we cannot read: as they are
        if "id" in obj:
            obj["id"] = self.first.response_id
        obj.pop("prompt_token_ids", None)
        for choice in obj.get("choices") or []:
            if isinstance(choice, dict):
                choice.pop("prompt_token_ids", None)
                _shift_offsets(choice.get("logprobs"), self.first.text_offset_shift)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            _shift_usage(usage)
        return _event(obj)


def _shift_usage(usage: dict[str, Any]) -> None:
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        usage["prompt_tokens"], usage["completion_tokens"] = prompt - 1, completion + 1


def _shift_offsets(logprobs: Any, shift: int) -> None:
    """Completions' text offsets of D's tokens, counted from the client's first token instead of D's."""
    offsets = logprobs.get("text_offset") if isinstance(logprobs, dict) else None
    if shift and isinstance(offsets, list):
        logprobs["text_offset"] = [o + shift if isinstance(o, int) else o for o in offsets]
