"""First token from prefill, against fake backends: P's token reaches the client before D is answered, D
continues from prompt + that token, D's events are rewritten, and whatever cannot be exact takes the usual flow."""

from __future__ import annotations

from typing import Any

import pytest

from kv_connectors.proxy.seed import first_token
from tests.unit.proxy.proxy_fakes import (
    KV_FROM_P,
    P1,
    P2,
    ChunkStream,
    Fleet,
    asgi_stream,
    config,
    metric_value,
    running,
    sse,
    tid_config,
)
from tests.unit.proxy.proxy_streams import (
    DONE,
    KV,
    LOAD_FAILED,
    PROMPT_IDS,
    d_chat_chunks,
    d_completion_chunks,
    events,
    failing_first,
    p_answer,
)

pytestmark = pytest.mark.anyio


def seeded_fleet(route: str) -> Fleet:
    fleet = Fleet()
    fleet[P1].answer = p_answer(route)
    chunks = d_chat_chunks() if route == "chat" else d_completion_chunks()
    fleet["http://d1.test:8200"].stream_factory = lambda: ChunkStream(list(chunks))
    return fleet


D1 = "http://d1.test:8200"


async def test_completions_first_token_from_prefill() -> None:
    fleet = seeded_fleet("cmpl")
    body = {
        "prompt": "hello",
        "max_tokens": 3,
        "min_tokens": 2,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json=body)
        text = (await client.get("/metrics")).text
    got = events(resp.content)
    assert [e["choices"][0]["text"] for e in got[:3]] == ["Hel", "lo", "!"]
    assert got[0]["choices"][0]["prompt_token_ids"] == PROMPT_IDS and got[0]["choices"][0]["token_ids"] == [50]
    assert all("prompt_token_ids" not in e["choices"][0] for e in got[1:3])  # D's (with the first token) dropped
    assert {e["id"] for e in got[:4]} == {"cmpl-p"}
    assert got[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6} and got[4] == "[DONE]"
    [p_body], [d_body] = fleet.bodies("prefill"), fleet.bodies("decode")
    assert p_body["return_token_ids"] is True and p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert d_body["prompt"] == PROMPT_IDS + [50] and d_body["max_tokens"] == 2 and d_body["min_tokens"] == 1
    assert d_body["kv_transfer_params"] == KV and d_body["stream"] is True
    assert metric_value(text, "kvc_proxy_first_token_total", result="seeded") == 1


async def test_chat_first_token_from_prefill() -> None:
    fleet = seeded_fleet("chat")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "stream": True, "return_token_ids": True}
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/chat/completions", json=body)
    got = events(resp.content)
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and got[0]["prompt_token_ids"] == PROMPT_IDS
    contents = [e["choices"][0]["delta"].get("content") for e in got[1:4]]
    assert contents == ["Hel", "lo", "!"] and got[1]["choices"][0]["token_ids"] == [50]
    assert sum("role" in e["choices"][0]["delta"] for e in got if e != "[DONE]" and e["choices"]) == 1  # D's role chunk dropped
    assert all("prompt_token_ids" not in e for e in got[1:] if e != "[DONE]")
    assert got[4]["usage"]["prompt_tokens"] == 3 and got[4]["usage"]["completion_tokens"] == 3
    [d_body] = fleet.bodies("decode")
    assert d_body["kv_transfer_params"] == {**KV, "prompt_token_ids": PROMPT_IDS + [50]}
    assert d_body["max_completion_tokens"] == 2 and d_body["messages"] == body["messages"]


async def test_the_first_token_does_not_wait_for_decode() -> None:
    fleet = seeded_fleet("cmpl")
    fleet[D1].hold = True  # D never answers
    async with running(config(decode_timeout_s=5), fleet) as (app, _):
        _, chunks = await asgi_stream(app, {"prompt": [1, 2], "stream": True, "max_tokens": 4}, disconnect_after=1)
    assert events(chunks[0])[0]["choices"][0]["text"] == "Hel"
    assert fleet[D1].started == 1 and fleet[D1].cancelled == 1  # D was asked, and aborted when the client left


@pytest.mark.parametrize(
    "answer",
    [p_answer("cmpl", finish="stop"), p_answer("cmpl", text=""), p_answer("cmpl", text="\ufffd"), p_answer("cmpl", text="a\ufffd")],
    ids=["p-stopped", "empty-text", "partial-character", "ends-in-partial-character"],
)
async def test_answers_that_cannot_seed_take_the_usual_flow(answer: Any) -> None:
    fleet = Fleet()
    fleet[P1].answer = answer
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": "hello", "stream": True, "max_tokens": 4})
        text = (await client.get("/metrics")).text
    assert resp.status_code == 200 and resp.content.startswith(b'data: {"id": "cmpl-d"')  # D's stream, as is
    [d_body] = fleet.bodies("decode")
    assert d_body["prompt"] == PROMPT_IDS and d_body["max_tokens"] == 4  # D generates from the first token
    assert metric_value(text, "kvc_proxy_first_token_total", result="answer_not_seedable") == 1


@pytest.mark.parametrize(
    "extra",
    [
        {"stream": False},
        {"stop": ["x"]},
        {"prompt_logprobs": 1},
        {"best_of": True},
        {"presence_penalty": 0.5},
        {"max_tokens": 1},
        {"echo": True},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"prompt": ["a", "b"]},
        {"response_format": {"type": "json_object"}},
    ],
    ids=lambda e: next(iter(e)) if len(e) == 1 else str(e),
)
async def test_requests_that_cannot_be_seeded_exactly_are_not(extra: dict) -> None:
    fleet = seeded_fleet("cmpl")
    async with running(config(), fleet) as (_, client):
        await client.post("/v1/completions", json={"prompt": [1, 2], "stream": True, "max_tokens": 4, **extra})
        text = (await client.get("/metrics")).text
    assert all(b.get("max_tokens") == extra.get("max_tokens", 4) for b in fleet.bodies("decode"))  # D generates all
    assert all(b["prompt"] != PROMPT_IDS + [50] for b in fleet.bodies("decode"))
    assert metric_value(text, "kvc_proxy_first_token_total", result="seeded") == 0


@pytest.mark.parametrize("cfg", [config(first_token_from_prefill=False), tid_config()], ids=["flag-off", "transfer-id-flow"])
async def test_off_by_flag_and_in_the_transfer_id_flow(cfg: Any) -> None:
    fleet = seeded_fleet("cmpl")
    async with running(cfg, fleet) as (_, client):
        await client.post("/v1/completions", json={"prompt": [1, 2], "stream": True, "max_tokens": 4})
    assert fleet.bodies("decode")[0]["prompt"] == [1, 2]


async def test_decode_failing_after_the_first_token_continues_on_decode_alone() -> None:
    fleet = Fleet((P1, P2))
    fleet[P1].answer = fleet[P2].answer = p_answer("cmpl")
    fleet[D1].stream_factory = failing_first(1, [LOAD_FAILED, DONE], d_completion_chunks())
    async with running(config((P1, P2)), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1, 2], "stream": True, "max_tokens": 3})
        text = (await client.get("/metrics")).text
    got = events(resp.content)
    assert [e["choices"][0]["text"] for e in got[:3]] == ["Hel", "lo", "!"] and b'"error"' not in resp.content
    first, second = fleet.bodies("decode")
    assert "kv_transfer_params" in first and "kv_transfer_params" not in second  # P's KV may be gone: D computes
    assert second["prompt"] == PROMPT_IDS + [50] and second["max_tokens"] == 2
    assert fleet.urls() == [P1, D1, D1]  # no second prefill: the client has the first token
    assert metric_value(text, "kvc_proxy_decode_only_total", mode="fallback") == 1
    assert metric_value(text, "kvc_proxy_requests_total", route="/v1/completions", outcome="ok") == 1


async def test_decode_failing_for_good_after_the_first_token_ends_with_an_error_event() -> None:
    fleet = seeded_fleet("cmpl")
    fleet[D1].stream_factory = failing_first(100, [LOAD_FAILED, DONE])
    async with running(config(max_retries=1), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1, 2], "stream": True, "max_tokens": 3})
        text = (await client.get("/metrics")).text
    got = events(resp.content)
    assert got[0]["choices"][0]["text"] == "Hel" and "after the first token" in got[1]["error"]["message"] and got[2] == "[DONE]"
    assert metric_value(text, "kvc_proxy_requests_total", route="/v1/completions", outcome="upstream_error") == 1


def test_first_token_reads_both_answer_shapes() -> None:
    chat = first_token("/v1/chat/completions", p_answer("chat")({}))
    cmpl = first_token("/v1/completions", p_answer("cmpl")({}))
    assert chat is not None and cmpl is not None and (chat.token_id, chat.text, cmpl.prompt_token_ids) == (50, "Hel", PROMPT_IDS)
    tool = p_answer("chat")({})
    tool["choices"][0]["message"]["tool_calls"] = [{"id": "x"}]
    assert first_token("/v1/chat/completions", tool) is None


async def test_a_prefill_without_a_prompt_digest_never_seeds() -> None:
    """vLLM's built-in connector states no prompt digest, and its D kills its engine on a prompt longer than
    P's: such a P's first token is not sent ahead."""
    fleet = seeded_fleet("cmpl")
    plain = p_answer("cmpl")

    def without_digest(body: dict[str, Any]) -> dict[str, Any]:
        return {**plain(body), "kv_transfer_params": KV_FROM_P}

    fleet[P1].answer = without_digest
    async with running(config(), fleet) as (_, client):
        await client.post("/v1/completions", json={"prompt": [1, 2], "stream": True, "max_tokens": 4})
        text = (await client.get("/metrics")).text
    [d_body] = fleet.bodies("decode")
    assert d_body["prompt"] == [1, 2] and d_body["max_tokens"] == 4
    assert metric_value(text, "kvc_proxy_first_token_total", result="no_prompt_digest") == 1


async def test_logprobs_are_p_s_for_the_first_token_and_d_s_after_it() -> None:
    """Completions: D's text offsets start past the first token (vLLM counts its token string)."""
    fleet = Fleet()
    plain = p_answer("cmpl")
    first_lp = {"text_offset": [0], "token_logprobs": [-0.5], "tokens": ["Hel"], "top_logprobs": [{"Hel": -0.5, "x": -2.0}]}

    def with_logprobs(body: dict[str, Any]) -> dict[str, Any]:
        assert body["logprobs"] == 1
        answer = plain(body)
        answer["choices"][0]["logprobs"] = first_lp
        return answer

    fleet[P1].answer = with_logprobs
    d_lp = {
        "text_offset": [0, 2],
        "token_logprobs": [-0.1, -0.2],
        "tokens": ["lo", "!"],
        "top_logprobs": [{"lo": -0.1}, {"!": -0.2}],
    }
    chunk = {"id": "cmpl-d", "choices": [{"index": 0, "text": "lo!", "logprobs": d_lp, "finish_reason": "length"}]}
    fleet[D1].stream_factory = lambda: ChunkStream([sse(chunk), DONE])
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1, 2], "stream": True, "max_tokens": 3, "logprobs": 1})
    got = events(resp.content)
    assert got[0]["choices"][0]["logprobs"] == first_lp
    assert got[1]["choices"][0]["logprobs"]["text_offset"] == [3, 5]  # 0 and 2, past "Hel"
    assert got[1]["choices"][0]["logprobs"]["tokens"] == ["lo", "!"]


async def test_chat_logprobs_of_the_first_token_come_from_p() -> None:
    fleet = seeded_fleet("chat")
    plain = p_answer("chat")
    lp = {"content": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108], "top_logprobs": []}]}

    def with_logprobs(body: dict[str, Any]) -> dict[str, Any]:
        answer = plain(body)
        answer["choices"][0]["logprobs"] = lp
        return answer

    fleet[P1].answer = with_logprobs
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True, "logprobs": True}
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/chat/completions", json=body)
    got = events(resp.content)
    assert got[0]["choices"][0]["logprobs"] is None and got[1]["choices"][0]["logprobs"] == lp
