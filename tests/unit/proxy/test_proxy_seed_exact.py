"""First token from prefill gives the client what one server would, for the request options that used to
differ (each failed before): the output limit as vLLM reads it, prompt truncation, chat with media, seeds
and bad words, token ids of held-back text; and a FIM request is a valid D request. vLLM 0.32's own
request models decide what D does with the body the proxy sends."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.proxy.proxy_fakes import D1, P1, ChunkStream, Fleet, config, metric_value, running, sse
from tests.unit.proxy.proxy_streams import DONE, PROMPT_IDS, d_chat_chunks, d_completion_chunks, events, p_answer

pytestmark = pytest.mark.anyio


def _vllm_max_out(route: str, body: dict[str, Any]) -> int | None:
    """The output budget vLLM 0.32 takes from a body (before the context-length clamp)."""
    if route == "cmpl":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return CompletionRequest(model="m", **{k: v for k, v in body.items() if k != "model"}).max_tokens
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    r = ChatCompletionRequest(model="m", **{k: v for k, v in body.items() if k != "model"})
    return r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens  # serving.py:343-347


async def _run(route: str, body: dict[str, Any]) -> tuple[Fleet, str, bytes]:
    fleet = Fleet()
    fleet[P1].answer = p_answer(route)
    chunks = d_chat_chunks() if route == "chat" else d_completion_chunks()
    fleet[D1].stream_factory = lambda: ChunkStream(list(chunks))
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    async with running(config(), fleet) as (_, client):
        resp = await client.post(path, json=body)
        text = (await client.get("/metrics")).text
    return fleet, text, resp.content


MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "route,body",
    [
        ("cmpl", {"prompt": [1, 2], "stream": True}),  # vLLM completions default max_tokens=16
        ("cmpl", {"prompt": [1, 2], "stream": True, "max_tokens": None}),  # normalized to 16 by vLLM
        ("cmpl", {"prompt": [1, 2], "stream": True, "max_tokens": 1, "max_completion_tokens": 5}),  # not a completions field
        ("chat", {"messages": MSGS, "stream": True, "max_tokens": 1, "max_completion_tokens": None}),
    ],
    ids=["cmpl-no-max-tokens", "cmpl-null-max-tokens", "cmpl-max-completion-ignored", "chat-null-max-completion"],
)
async def test_seeded_answer_has_the_length_one_server_gives(route: str, body: dict[str, Any]) -> None:
    fleet, text, _ = await _run(route, body)
    want = _vllm_max_out(route, body)
    if metric_value(text, "kvc_proxy_first_token_total", result="seeded") == 0:
        return  # the usual flow: D generates everything
    [d_body] = fleet.bodies("decode")
    got = 1 + _vllm_max_out(route, d_body)  # P's token + D's budget
    assert got == want, f"client asked for (vLLM's reading) {want} tokens, seeded flow produces up to {got}"


async def test_seeded_truncate_prompt_tokens_keeps_the_context() -> None:
    """P truncates to k tokens; D gets k ids + the first token and the same truncate_prompt_tokens=k, so D drops a
    token of the context (left side) or the first token itself (right side)."""
    fleet, text, _ = await _run("cmpl", {"prompt": "a long prompt", "stream": True, "max_tokens": 4, "truncate_prompt_tokens": 3})
    for d_body in fleet.bodies("decode"):
        limit = d_body.get("truncate_prompt_tokens")
        assert limit is None or limit < 0 or len(d_body["prompt"]) <= limit, d_body


async def test_seeded_multimodal_chat_d_ignores_the_forwarded_ids() -> None:
    """vLLM 0.32 drops kv_transfer_params.prompt_token_ids when a message has non-text content
    (chat_completion/protocol.py drop_prompt_token_ids_with_media; renderers/online_renderer.py
    _reused_prompt_token_ids): D renders the prompt WITHOUT P's first token and generates it again."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]
    fleet, _, _ = await _run("chat", {"messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": 4})
    [d_body] = fleet.bodies("decode")
    seen_by_d = ChatCompletionRequest(**{"model": "m", **d_body}).kv_transfer_params or {}
    if d_body["max_tokens"] == 3:  # seeded: D must continue from prompt + first token
        assert seen_by_d.get("prompt_token_ids") == PROMPT_IDS + [50], "D renders messages: the first token is generated twice"


@pytest.mark.parametrize(
    "extra",
    [{"seed": 7, "temperature": 1.0}, {"bad_words": ["Hello world"]}],
    ids=["seed", "bad_words"],
)
async def test_sampling_state_that_does_not_cross_p_to_d_is_not_seeded(extra: dict[str, Any]) -> None:
    """seed: D's per-request torch.Generator starts fresh (v1/worker/gpu_model_runner.py manual_seed), so D's
    first draw (for token 2) is the draw P used for token 1; bad_words: matched against OUTPUT tokens only
    (v1/sample/sampler.py apply_bad_words(..., output_token_ids)) and P's token is in D's prompt."""
    _, text, _ = await _run("cmpl", {"prompt": [1, 2], "stream": True, "max_tokens": 4, **extra})
    assert metric_value(text, "kvc_proxy_first_token_total", result="seeded") == 0


async def test_seeded_chat_keeps_every_token_id() -> None:
    """vLLM 0.32 chat streaming with return_token_ids sends a chunk with delta {"content": ""} and the token id for
    a token whose text is held back (a partial UTF-8 character; chat_completion/serving.py 'we still need to send a
    chunk even if delta_message is None'). The rewriter classifies it as preamble and drops it: a token id lost."""
    head = {"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 8, "model": "m"}
    d_chunks = [
        sse(
            {
                **head,
                "prompt_token_ids": PROMPT_IDS + [50],
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
        ),
        sse(
            {
                **head,
                "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": None, "token_ids": [51], "finish_reason": None}],
            }
        ),
        sse(
            {
                **head,
                "choices": [
                    {"index": 0, "delta": {"content": "\u4e2d"}, "logprobs": None, "token_ids": [52], "finish_reason": "length"}
                ],
            }
        ),
        DONE,
    ]
    fleet = Fleet()
    fleet[P1].answer = p_answer("chat")
    fleet[D1].stream_factory = lambda: ChunkStream(list(d_chunks))
    body = {"messages": MSGS, "stream": True, "max_tokens": 3, "return_token_ids": True}
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/chat/completions", json=body)
    ids = [t for e in events(resp.content) if e != "[DONE]" for c in e["choices"] for t in c.get("token_ids") or []]
    assert ids == [50, 51, 52], ids


async def test_fim_suffix_with_forwarded_ids_is_a_valid_d_request() -> None:
    """Params flow, text prompt with `suffix` (FIM): D gets P's ids as its prompt and the client's suffix;
    vLLM 0.32 answers 400 'suffix requires text prompt input' (renderers/online_renderer.py)."""
    fleet = Fleet()
    async with running(config(), fleet) as (_, client):
        await client.post("/v1/completions", json={"prompt": "def f(", "suffix": "):\n    pass", "max_tokens": 8})
    [d_body] = fleet.bodies("decode")
    assert not (isinstance(d_body["prompt"], list) and d_body.get("suffix")), d_body
