"""What D sends before its first token is held: an error there (a failed KV load) is retried, not relayed."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.unit.proxy.proxy_fakes import (
    D1,
    P1,
    P2,
    ChunkStream,
    Fleet,
    asgi_stream,
    config,
    metric_value,
    running,
    sse,
    text_chunks,
    tid_config,
)
from tests.unit.proxy.proxy_streams import DONE, LOAD_FAILED, failing_first

pytestmark = pytest.mark.anyio

ROLE_CHUNK = sse(
    {
        "id": "chatcmpl-d",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
    }
)


def _no_error_event(content: bytes) -> None:
    assert b'"error"' not in content, content


@pytest.mark.parametrize("preamble", [[], [ROLE_CHUNK]])
async def test_error_event_before_first_token_is_retried_with_a_fresh_prefill(preamble: list[bytes]) -> None:
    fleet = Fleet((P1, P2), (D1,))
    fleet[D1].stream_factory = failing_first(1, preamble + [LOAD_FAILED, DONE])
    async with running(config((P1, P2)), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
        text = (await client.get("/metrics")).text
        health = (await client.get("/health")).json()
    assert resp.status_code == 200
    assert resp.content == b"".join(text_chunks(["a", "b"]))  # nothing of the failed stream, the role chunk included
    _no_error_event(resp.content)
    # D answered (it is up): the same D again, with KV from a fresh prefill on the other P
    assert fleet.urls() == [P1, D1, P2, D1]
    assert fleet.bodies(D1)[1]["kv_transfer_params"]["remote_engine_id"] == "eng-p"
    assert metric_value(text, "kvc_proxy_retries_total", role="decode") == 1
    assert metric_value(text, "kvc_proxy_requests_total", route="/v1/completions", outcome="ok") == 1
    assert all(b["healthy"] for b in health["decode"] + health["prefill"])


async def test_error_event_with_every_retry_failing_reaches_the_client_once() -> None:
    fleet = Fleet((P1, P2), (D1,))
    fleet[D1].stream_factory = failing_first(100, [LOAD_FAILED, DONE])
    async with running(config((P1, P2), max_retries=1), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
    assert resp.status_code == 502, resp.text
    assert "before its first token" in resp.json()["error"]["message"]
    assert fleet.urls() == [P1, D1, P2, D1]  # bounded by --max-retries


async def test_non_streamed_decode_500_is_retried_on_the_only_d() -> None:
    fleet = Fleet((P1, P2), (D1,))
    fleet[D1].status, fleet[D1].status_times = 500, 1  # D's load failed: vLLM answers 500
    async with running(config((P1, P2)), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1]})
    assert resp.status_code == 200, resp.text
    assert fleet.urls() == [P1, D1, P2, D1]


async def test_chat_role_chunk_alone_is_held_until_a_token() -> None:
    fleet = Fleet((P1,), (D1,))
    content = sse(
        {
            "id": "chatcmpl-d",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}],
        }
    )
    fleet[D1].stream_factory = lambda: ChunkStream([ROLE_CHUNK, content, DONE], delay_s=0.01)
    async with running(config(), fleet) as (app, _):
        _, chunks = await asgi_stream(
            app, {"messages": [{"role": "user", "content": "x"}], "stream": True}, path="/v1/chat/completions"
        )
    # the role chunk went out together with the first token, not before it
    assert chunks[0] == ROLE_CHUNK + content and b"".join(chunks) == ROLE_CHUNK + content + DONE


async def test_transfer_id_flow_error_event_retries_the_pair_with_a_new_transfer_id() -> None:
    fleet = Fleet((P1, P2), (D1,))
    fleet[D1].stream_factory = failing_first(1, [LOAD_FAILED, DONE])
    cfg = tid_config((P1, P2), (D1,))
    async with running(cfg, fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
    assert resp.status_code == 200 and resp.content == b"".join(text_chunks(["a", "b"]))
    d_ids = [b["kv_transfer_params"]["transfer_id"] for b in fleet.bodies(D1)]
    p_urls = [u for u in fleet.urls() if u in (P1, P2)]
    assert len(d_ids) == 2 and d_ids[0] != d_ids[1] and p_urls == [P1, P2]


async def test_client_closing_right_after_done_is_a_completed_request() -> None:
    fleet = Fleet()
    # D sends [DONE] and then keeps its connection open a little: the client leaves first
    fleet[D1].stream_factory = lambda: ChunkStream(text_chunks(["a", "b"]) + [b": keep-alive\n\n"], delay_s=0.05)
    async with running(config(), fleet) as (app, client):
        _, chunks = await asgi_stream(app, {"prompt": [1], "stream": True}, disconnect_after=3)
        text = (await client.get("/metrics")).text
    assert b"".join(chunks).endswith(DONE)
    assert metric_value(text, "kvc_proxy_requests_total", route="/v1/completions", outcome="ok") == 1
    assert metric_value(text, "kvc_proxy_requests_total", route="/v1/completions", outcome="client_disconnected") == 0


def test_error_event_parsing_is_what_vllm_sends() -> None:
    from kv_connectors.proxy.sse import EventKind, classify_event

    assert classify_event(LOAD_FAILED.strip()) is EventKind.ERROR
    assert classify_event(ROLE_CHUNK.strip()) is EventKind.PREAMBLE
    assert classify_event(DONE.strip()) is EventKind.DONE
    assert classify_event(text_chunks(["a"])[0].strip()) is EventKind.OUTPUT
    finish = sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    assert classify_event(finish.strip()) is EventKind.OUTPUT
    assert classify_event(b": comment") is EventKind.PREAMBLE
    assert json.loads(LOAD_FAILED[6:])["error"]["code"] == 500


# -- decode-only: no prefill server left --


async def test_every_prefill_failing_falls_back_to_decode_alone() -> None:
    fleet = Fleet((P1, P2), (D1,))
    for p in (P1, P2):
        fleet[p].error = httpx.ConnectError("connection refused")
    async with running(config((P1, P2)), fleet) as (_, client):
        first = await client.post("/v1/completions", json={"prompt": [1], "kv_transfer_params": {"junk": 1}})
        second = await client.post("/v1/completions", json={"prompt": [2]})  # both P now evicted: straight to D
        text = (await client.get("/metrics")).text
        health = await client.get("/health")
    assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
    assert fleet.urls() == [P1, P2, D1, D1]
    assert all("kv_transfer_params" not in b for b in fleet.bodies(D1))  # D computes the prompt itself
    assert metric_value(text, "kvc_proxy_decode_only_total", mode="fallback") == 2
    assert metric_value(text, "kvc_proxy_decode_only_total", mode="local") == 0
    # the proxy still serves: ready, with the prefill servers shown down
    assert health.status_code == 200 and [b["healthy"] for b in health.json()["prefill"]] == [False, False]


@pytest.mark.parametrize("flow", ["params", "transfer-id"])
async def test_error_event_with_the_only_p_falls_back_to_decode_alone(flow: str) -> None:
    # P killed after answering: D's load fails; no other P, so D computes the prompt itself
    fleet = Fleet((P1,), (D1,))
    fleet[D1].stream_factory = failing_first(1, [ROLE_CHUNK, LOAD_FAILED, DONE])
    cfg = tid_config() if flow == "transfer-id" else config()
    async with running(cfg, fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
        text = (await client.get("/metrics")).text
    assert resp.status_code == 200 and resp.content == b"".join(text_chunks(["a", "b"]))
    assert fleet.urls() == [P1, D1, D1]
    assert "kv_transfer_params" not in fleet.bodies(D1)[1]
    assert metric_value(text, "kvc_proxy_decode_only_total", mode="fallback") == 1


async def test_fallback_off_fails_without_a_prefill_server() -> None:
    fleet = Fleet((P1,), (D1,))
    fleet[P1].error = httpx.ConnectError("connection refused")
    async with running(config(decode_only_fallback=False), fleet) as (_, client):
        first = await client.post("/v1/completions", json={"prompt": [1]})
        second = await client.post("/v1/completions", json={"prompt": [1]})
        health = await client.get("/health")
    assert first.status_code == 502 and second.status_code == 503
    assert second.json()["error"]["message"] == "no healthy prefill server"
    assert fleet.urls() == [P1] and health.status_code == 503


# -- --local-prefill-below: short prompts go to D alone --


async def test_short_prompts_go_to_decode_alone_long_ones_are_disaggregated() -> None:
    fleet = Fleet((P1,), (D1,))
    long_text = " ".join(["word"] * 20)
    async with running(config(local_prefill_below=8), fleet) as (_, client):
        for body in ({"prompt": [1, 2, 3]}, {"prompt": list(range(8))}, {"prompt": "hi"}, {"prompt": long_text}):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        chat = {"messages": [{"role": "user", "content": "a b c d e"}], "chat_template_kwargs": {"x": 1}}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        text = (await client.get("/metrics")).text
    # 3 ids: local; 8 ids: not below 8; "hi": shorter than 8 by its bytes (no /tokenize); 20 words: counted, not
    # below; the chat: 5 words + 3 of template = 8 tokens, not below
    assert fleet.urls() == [D1, P1, D1, D1, P1, D1, P1, D1]
    assert fleet.tokenize_calls == [
        {"prompt": long_text},
        {"messages": chat["messages"], "chat_template_kwargs": {"x": 1}},
    ]
    assert "kv_transfer_params" not in fleet.bodies(D1)[0]
    assert metric_value(text, "kvc_proxy_decode_only_total", mode="local") == 2


async def test_a_list_of_prompts_is_decided_per_prompt_and_tokenize_failing_disaggregates() -> None:
    fleet = Fleet((P1,), (D1,))
    async with running(config(local_prefill_below=4), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [[1], list(range(10))]})
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 2
        assert sorted(fleet.urls()) == sorted([D1, P1, D1])  # [1] alone on D, the 10 ids through P
        fleet.calls.clear()
        fleet.tokenize_status = 500
        resp = await client.post("/v1/completions", json={"prompt": "one two three four five six seven"})
        assert resp.status_code == 200
    assert fleet.urls() == [P1, D1]
