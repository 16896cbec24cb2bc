"""The proxy app in the params (NIXL) flow against fake P/D backends (httpx.MockTransport), no vLLM."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import httpx
import pytest

import kv_connectors.proxy
from kv_connectors.proxy.config import Policy
from kvc_testing.procs import free_port
from tests.unit.proxy.proxy_fakes import (
    D1,
    D2,
    KV_FROM_P,
    P1,
    P2,
    PROMPT_IDS,
    ChunkStream,
    Fleet,
    asgi_stream,
    config,
    metric_value,
    running,
    sse,
    text_chunks,
)

pytestmark = pytest.mark.anyio


def _assert_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


async def test_prefill_then_decode_bodies() -> None:
    fleet = Fleet()
    body = {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 16,
        "min_tokens": 4,
        "stream": False,
        "temperature": 0,
        "kv_transfer_params": {"client": "junk"},
    }
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200 and resp.json()["id"] == "cmpl-d"
    [p_body], [d_body] = fleet.bodies("prefill"), fleet.bodies("decode")
    assert p_body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False and "min_tokens" not in p_body
    assert p_body["prompt"] == [5, 6, 7] and p_body["temperature"] == 0
    assert "return_token_ids" not in p_body  # the prompt is already token ids
    assert d_body == {**body, "kv_transfer_params": KV_FROM_P}
    assert fleet.urls() == [P1, D1]


async def test_completions_string_prompt_forwards_p_token_ids() -> None:
    fleet = Fleet()
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
        assert resp.status_code == 200
        [p_body], [d_body] = fleet.bodies("prefill"), fleet.bodies("decode")
        assert p_body["return_token_ids"] is True and p_body["prompt"] == "hello there"
        assert d_body["prompt"] == PROMPT_IDS and "return_token_ids" not in d_body
        assert "prompt_token_ids" not in d_body["kv_transfer_params"]
        fleet.calls.clear()
        # echo: D must render the client's text, so no forwarding
        assert (await client.post("/v1/completions", json={"prompt": "hi", "echo": True})).status_code == 200
        [p_body], [d_body] = fleet.bodies("prefill"), fleet.bodies("decode")
        assert "return_token_ids" not in p_body and d_body["prompt"] == "hi"


async def test_chat_forwards_token_ids_and_max_completion_tokens() -> None:
    fleet = Fleet()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    async with running(config(), fleet) as (_, client):
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    [p_body], [d_body] = fleet.bodies("prefill"), fleet.bodies("decode")
    assert p_body["max_completion_tokens"] == 1 and p_body["max_tokens"] == 1 and p_body["return_token_ids"]
    assert d_body["max_completion_tokens"] == 9 and "max_tokens" not in d_body
    assert d_body["kv_transfer_params"] == {**KV_FROM_P, "prompt_token_ids": PROMPT_IDS}
    assert d_body["messages"] == body["messages"]
    assert {c.path for c in fleet.calls} == {"/v1/chat/completions"}


async def test_streaming_passthrough_and_stream_options_only_to_d() -> None:
    fleet = Fleet()
    body = {"prompt": [1, 2], "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert resp.content == b"".join(text_chunks(["a", "b"]))
    [p_body], [d_body] = fleet.bodies("prefill"), fleet.bodies("decode")
    assert p_body["stream"] is False and "stream_options" not in p_body
    assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}
    assert fleet[D1].streams[0].closed


async def test_stream_is_relayed_chunk_by_chunk() -> None:
    fleet = Fleet()
    chunks = text_chunks(["a", "b", "c"])
    fleet[D1].stream_factory = lambda: ChunkStream(chunks, delay_s=0.01)
    async with running(config(), fleet) as (app, _):
        _, got = await asgi_stream(app, {"prompt": "a", "stream": True})
    assert got == chunks


async def test_request_id_propagated_or_generated() -> None:
    fleet = Fleet()
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": "a"}, headers={"X-Request-Id": "rid-42"})
        assert resp.headers["x-request-id"] == "rid-42"
        assert [c.headers["x-request-id"] for c in fleet.calls] == ["rid-42", "rid-42"]
        fleet.calls.clear()
        resp = await client.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer k"})
    generated = resp.headers["x-request-id"]
    assert len(generated) == 32 and [c.headers["x-request-id"] for c in fleet.calls] == [generated] * 2
    assert [c.headers["authorization"] for c in fleet.calls] == ["Bearer k"] * 2


async def test_split_prompts_non_streaming() -> None:
    fleet = Fleet(decode=(D1, D2))
    prompts = ["one", "two", "three"]
    async with running(config(decode=(D1, D2)), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 3}, headers={"X-Request-Id": "r"})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    # each prompt went alone to P, and D got that prompt's own token ids from its P
    p_prompts = sorted(b["prompt"] for b in fleet.bodies("prefill"))
    assert p_prompts == sorted(prompts) and all(b["prompt"] == PROMPT_IDS for b in fleet.bodies("decode"))
    assert answer["usage"] == {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}
    ids = sorted(c.headers["x-request-id"] for c in fleet.calls if fleet[c.url].role == "prefill")
    assert ids == ["r-0", "r-1", "r-2"]
    assert {c["from"] for c in answer["choices"]} == {D1, D2}


async def test_split_token_id_prompts_keep_order() -> None:
    fleet = Fleet()
    prompts = [[4, 5], [6], [7, 8, 9]]
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": prompts})
    choices = resp.json()["choices"]
    assert [c["text"] for c in choices] == [f"decoded({p!r})" for p in prompts]
    assert all("return_token_ids" not in b for b in fleet.bodies("prefill"))


async def test_split_prompts_streaming_merged() -> None:
    fleet = Fleet()
    usage = {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    fleet[D1].stream_factory = lambda: ChunkStream(text_chunks(["x", "y"], usage), delay_s=0.005)
    body = {"prompt": ["a", "b", "c"], "stream": True, "stream_options": {"include_usage": True}}
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json=body)
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and sum(e == b"data: [DONE]" for e in events) == 1
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    *chunks, usage_chunk = payloads
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {k: 3 * v for k, v in usage.items()}
    for index in range(3):
        assert [c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == index] == ["x", "y"]
    assert len(chunks) == 6 and all(s.closed for s in fleet[D1].streams)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"{not json", "invalid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'"text"', "JSON object"),
        (b"", "invalid JSON"),
    ],
)
async def test_invalid_json_is_400(raw: bytes, message: str) -> None:
    fleet = Fleet()
    async with running(config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert message in _assert_error(resp, 400)["message"]
        assert (await client.post("/v1/completions", json={"prompt": "ok"})).status_code == 200
    assert fleet.urls() == [P1, D1]


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"prompt": "x"}, "messages"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": ["a", 3]}, "prompt"),
        ("/v1/completions", {"prompt": [[1], []]}, "prompt"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "9"}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{}], "max_completion_tokens": -1}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "a", "n": 2}, "'n' > 1"),
        ("/v1/completions", {"prompt": "a", "n": 0}, "'n'"),
    ],
)
async def test_bad_fields_are_400(route: str, body: dict, field: str) -> None:
    fleet = Fleet()
    async with running(config(), fleet) as (app, client):
        error = _assert_error(await client.post(route, json=body), 400)
        assert field in error["message"] and error["type"] == "invalid_request_error"
        assert (await client.post("/v1/completions", json={"prompt": "ok"})).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert fleet.urls() == [P1, D1]
    assert metric_value(metrics, "kvc_proxy_requests_total", route=route, outcome="bad_request") == 1


async def test_body_over_limit_is_413() -> None:
    fleet = Fleet()
    async with running(config(max_body_bytes=2048), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": "x" * 4096})
        _assert_error(resp, 413)

        async def parts():  # no content-length: the limit is enforced while reading
            for part in (b'{"prompt": "', b"y" * 4096, b'"}'):
                yield part

        chunked = await client.post("/v1/completions", content=parts())
        _assert_error(chunked, 413)
        assert (await client.post("/v1/completions", json={"prompt": "ok"})).status_code == 200
    assert fleet.urls() == [P1, D1]


async def test_backend_4xx_passes_through_5xx_is_mapped() -> None:
    fleet = Fleet()
    async with running(config(max_retries=0), fleet) as (_, client):
        fleet[P1].status = 400  # e.g. prompt longer than the model's context: P's own error as is
        resp = await client.post("/v1/completions", json={"prompt": "a"})
        assert resp.status_code == 400 and resp.json()["error"]["message"] == "prefill failed"
        fleet[P1].status = 200
        fleet[D1].status = 400
        resp = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
        assert resp.status_code == 400 and resp.json()["error"]["message"] == "decode failed"
        fleet[D1].status = 500
        error = _assert_error(await client.post("/v1/completions", json={"prompt": "a"}), 502)
        assert D1 in error["message"] and "500" in error["message"]
        fleet[P1].status = 503
        error = _assert_error(await client.post("/v1/completions", json={"prompt": "a"}), 502)
        assert P1 in error["message"] and "prefill" in error["message"]


async def test_prefill_without_kv_params_still_decodes() -> None:
    fleet = Fleet()
    fleet[P1].answer = lambda body: {"id": "p", "choices": [{"text": "x"}]}
    async with running(config(), fleet) as (_, client):
        assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
    [d_body] = fleet.bodies("decode")
    assert "kv_transfer_params" not in d_body


async def test_round_robin_pairs() -> None:
    fleet = Fleet((P1, P2), (D1, D2))
    async with running(config((P1, P2), (D1, D2)), fleet) as (_, client):
        for _ in range(4):
            assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
    assert fleet.urls() == [P1, D1, P2, D2, P1, D1, P2, D2]


async def test_least_outstanding_avoids_busy_decode() -> None:
    fleet = Fleet(decode=(D1, D2))
    fleet[D1].stream_factory = lambda: ChunkStream([sse({"choices": [{"index": 0, "text": "z"}]})] * 50, delay_s=0.02)
    cfg = config(decode=(D1, D2), decode_policy=Policy.LEAST_OUTSTANDING)
    async with running(cfg, fleet) as (app, client):
        long_stream = asyncio.create_task(asgi_stream(app, {"prompt": [1], "stream": True}))
        while not fleet[D1].streams:
            await asyncio.sleep(0.005)
        for _ in range(3):
            resp = await client.post("/v1/completions", json={"prompt": [2]})
            assert resp.json()["choices"][0]["from"] == D2
        await long_stream
        snapshot = (await client.get("/health")).json()["decode"]
    assert [(b["url"], b["outstanding"], b["served"]) for b in snapshot] == [(D1, 0, 1), (D2, 0, 3)]


async def test_models_health_and_metrics() -> None:
    fleet = Fleet((P1,), (D2, D1))
    async with running(config((P1,), (D2, D1)), fleet) as (_, client):
        models = await client.get("/v1/models")
        await client.post("/v1/completions", json={"prompt": [1]})
        await client.post("/v1/completions", json={"prompt": [1], "stream": True})
        health = await client.get("/health")
        metrics = await client.get("/metrics")
    assert models.status_code == 200 and models.json()["data"][0]["from"] == D2
    assert health.status_code == 200
    h = health.json()
    assert h["status"] == "ok" and h["flow"] == "params"
    assert h["prefill"] == [
        {"url": P1, "healthy": True, "draining": False, "outstanding": 0, "served": 2, "failures": 0, "side_channel": None}
    ]
    assert [b["url"] for b in h["decode"]] == [D2, D1]
    text = metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")
    assert metric_value(text, "kvc_proxy_requests_total", route="/v1/completions", outcome="ok") == 2
    assert metric_value(text, "kvc_proxy_backend_requests_total", role="prefill", url=P1) == 2
    assert metric_value(text, "kvc_proxy_backend_requests_total", role="decode", url=D2) == 1
    assert metric_value(text, "kvc_proxy_backend_seconds_count", role="decode", url=D1) == 1
    assert metric_value(text, "kvc_proxy_ttft_seconds_count") == 1  # the streamed one
    assert metric_value(text, "kvc_proxy_backend_healthy", role="decode", url=D1) == 1
    for name in ("kvc_proxy_retries_total", "kvc_proxy_evictions_total"):
        for role in ("prefill", "decode"):
            assert f'{name}{{role="{role}"}} 0.0' in text


async def test_one_log_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet()
    with caplog.at_level(logging.INFO, logger="kv_connectors.proxy"):
        async with running(config(), fleet) as (_, client):
            await client.post("/v1/completions", json={"prompt": "a"}, headers={"X-Request-Id": "rid-log"})
            await client.post("/v1/completions", json={"prompt": "a", "stream": True}, headers={"X-Request-Id": "rid-stream"})
    for rid in ("rid-log", "rid-stream"):
        [line] = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
        assert f"P={P1} D={D1} retries=0 status=200 outcome=ok" in line
        assert "p_answer=0." in line and "d_first_byte=0." in line and "total=" in line


def test_real_network_refused_and_timeout() -> None:
    """Through real sockets: a closed port gives 502, a server that never answers gives 504."""

    async def one(p_url: str) -> httpx.Response:
        app = kv_connectors.proxy.build_app(config((p_url,), (D1,), prefill_timeout_s=0.5, max_retries=0), health_checks=False)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as client:
                return await client.post("/v1/completions", json={"prompt": "a"})

    with socket.socket() as silent:  # listens (the kernel completes the handshake) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        _assert_error(asyncio.run(one(f"http://127.0.0.1:{free_port()}")), 502)
        error = _assert_error(asyncio.run(one(f"http://127.0.0.1:{silent.getsockname()[1]}")), 504)
        assert "timed out" in error["message"]
