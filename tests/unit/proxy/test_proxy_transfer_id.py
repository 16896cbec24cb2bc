"""The transfer-id flow (Mooncake-style: P and D addressed together) against fake backends."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest

import kv_connectors.proxy.flows as flows
from kv_connectors.proxy.config import BackendSpec, Flow, SideChannel
from tests.unit.proxy.proxy_fakes import (
    D1,
    D2,
    P1,
    P2,
    SIDE_CHANNELS,
    Call,
    Fleet,
    asgi_stream,
    config,
    metric_value,
    running,
    tid_config,
)

pytestmark = pytest.mark.anyio


def _p_kv(body: dict[str, Any]) -> dict[str, Any]:
    return body["kv_transfer_params"]


async def test_bodies_carry_one_transfer_id_and_p_side_channel() -> None:
    fleet = Fleet()
    body = {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"junk": 1},
    }
    async with running(tid_config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json=body)
        health = (await client.get("/health")).json()
    assert resp.status_code == 200
    [p_body], [d_body] = fleet.bodies("prefill"), fleet.bodies("decode")
    transfer_id = p_body["kv_transfer_params"]["transfer_id"]
    assert transfer_id.startswith("kvc-") and len(transfer_id) == 36
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False and "stream_options" not in p_body
    assert "return_token_ids" not in p_body
    assert d_body == {
        **body,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_host": "10.0.0.1",
            "remote_port": 5710,
        },
    }
    assert health["flow"] == "transfer-id" and health["prefill"][0]["side_channel"] == "10.0.0.1:5710"


async def test_a_data_parallel_p_gets_each_prompt_on_the_engine_d_is_told() -> None:
    """P of 2 data-parallel engines, one side channel each (port + rank): P's request is pinned to an
    engine (vLLM's X-data-parallel-rank), in turn, and D is named that engine's side channel (else D
    asks engine 0 for KV another engine holds)."""
    fleet = Fleet()
    cfg = config(side_channels={})
    cfg = dataclasses.replace(cfg, prefill=(BackendSpec(P1, SideChannel("10.0.0.1", 5600, 2)),))
    assert cfg.resolved_flow is Flow.TRANSFER_ID
    async with running(cfg, fleet) as (_, client):
        for _ in range(4):
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})).status_code == 200
    p_calls = [c for c in fleet.calls if c.url == P1]
    ranks = [c.headers.get("x-data-parallel-rank") for c in p_calls]
    assert ranks == ["0", "1", "0", "1"]
    ports = [_p_kv(b)["remote_port"] for b in fleet.bodies("decode")]
    assert ports == [5600, 5601, 5600, 5601]
    p_ids = [_p_kv(c.body)["transfer_id"] for c in p_calls]
    assert p_ids == [_p_kv(b)["transfer_id"] for b in fleet.bodies("decode")]


async def test_a_single_engine_p_gets_no_rank_header() -> None:
    fleet = Fleet()
    async with running(tid_config(), fleet) as (_, client):
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})).status_code == 200
    [p_call] = [c for c in fleet.calls if c.url == P1]
    assert "x-data-parallel-rank" not in p_call.headers


async def test_d_is_sent_before_p_answers() -> None:
    """P only answers once D's request has arrived: a sequential proxy would deadlock (and time out)."""
    fleet = Fleet()
    d_arrived = asyncio.Event()

    def on_request(call: Call) -> None:
        if call.url == D1:
            d_arrived.set()

    async def p_waits_for_d(server_answer: Any = None) -> None:
        await asyncio.wait_for(d_arrived.wait(), 2)

    fleet.on_request = on_request
    original = fleet._answer

    async def answer(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
        if server.role == "prefill":
            await p_waits_for_d()
        return await original(server, path, body)

    fleet._answer = answer  # type: ignore[method-assign]
    async with running(tid_config(), fleet) as (_, client):
        for stream in (False, True):
            d_arrived.clear()
            resp = await client.post("/v1/completions", json={"prompt": [1], "stream": stream})
            assert resp.status_code == 200, resp.text
    assert fleet[P1].cancelled == 0 and len(fleet.bodies("decode")) == 2


async def test_p_failure_cancels_d_and_retries_pair_with_new_transfer_id() -> None:
    fleet = Fleet((P1, P2), (D1,))
    fleet[P1].delay_s = 0.05  # D is waiting for the KV when P fails
    fleet[P1].error = httpx.ConnectError("refused")
    fleet[D1].delay_s = 0.3  # (a real D waits for the KV; this one answers only if not aborted)
    async with running(tid_config((P1, P2)), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1]})
        text = (await client.get("/metrics")).text
    assert resp.status_code == 200
    p_bodies, d_bodies = fleet.bodies("prefill"), fleet.bodies("decode")
    assert [c.url for c in fleet.calls] == [P1, D1, P2, D1]
    assert fleet[D1].cancelled == 1  # the first D request was aborted
    first, second = (_p_kv(b)["transfer_id"] for b in p_bodies)
    assert first != second and [_p_kv(b)["transfer_id"] for b in d_bodies] == [first, second]
    assert _p_kv(d_bodies[1])["remote_host"] == "10.0.0.2" and _p_kv(d_bodies[1])["remote_port"] == 5711
    assert metric_value(text, "kvc_proxy_retries_total", role="prefill") == 1


async def test_p_4xx_goes_to_client_and_aborts_d() -> None:
    fleet = Fleet()
    fleet[P1].status = 400
    fleet[D1].hold = True
    async with running(tid_config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1]})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "prefill failed"
    assert fleet[D1].cancelled == 1


async def test_d_unreachable_retried_with_same_transfer_id_and_p() -> None:
    fleet = Fleet((P1,), (D1, D2))
    fleet[D1].error = httpx.ConnectError("refused")
    async with running(tid_config(decode=(D1, D2)), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
    assert resp.status_code == 200
    [p_body] = fleet.bodies("prefill")
    d_bodies = fleet.bodies("decode")
    assert [c.url for c in fleet.calls if c.url != P1] == [D1, D2]
    assert {_p_kv(b)["transfer_id"] for b in d_bodies} == {_p_kv(p_body)["transfer_id"]}


async def test_d_dropped_retries_whole_pair() -> None:
    fleet = Fleet((P1, P2), (D1, D2))
    fleet[D1].error = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    async with running(tid_config((P1, P2), (D1, D2)), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1]})
    assert resp.status_code == 200
    p_ids = [_p_kv(b)["transfer_id"] for b in fleet.bodies("prefill")]
    d_ids = [_p_kv(b)["transfer_id"] for b in fleet.bodies("decode")]
    assert len(set(p_ids)) == 2 and d_ids == p_ids
    assert sorted(c.url for c in fleet.calls) == [D1, D2, P1, P2]


async def test_p_still_running_when_d_answers_is_settled() -> None:
    fleet = Fleet()
    fleet[P1].hold = True  # P never answers; D has its KV (it answered)
    async with running(tid_config(), fleet) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": [1]})
        health = (await client.get("/health")).json()
    assert resp.status_code == 200 and fleet[P1].cancelled == 1
    assert health["prefill"][0]["outstanding"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_aborts_p_and_d(stream: bool) -> None:
    fleet = Fleet()
    fleet[P1].hold = True
    fleet[D1].hold = True
    gone = asyncio.Event()
    seen: set[str] = set()

    def on_request(call: Call) -> None:
        seen.add(call.url)
        if seen == {P1, D1}:
            asyncio.get_running_loop().call_later(0.05, gone.set)

    fleet.on_request = on_request
    async with running(tid_config(), fleet) as (app, client):
        await asgi_stream(app, {"prompt": [1], "stream": stream}, disconnect=gone)
        health = (await client.get("/health")).json()
    assert fleet[P1].cancelled == 1 and fleet[D1].cancelled == 1
    assert health["prefill"][0]["outstanding"] == 0 and health["decode"][0]["outstanding"] == 0


async def test_explicit_params_flow_ignores_side_channels() -> None:
    fleet = Fleet()
    cfg = config(side_channels=SIDE_CHANNELS, flow=Flow.PARAMS)
    async with running(cfg, fleet) as (_, client):
        assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
    [p_body] = fleet.bodies("prefill")
    assert "transfer_id" not in p_body["kv_transfer_params"] and fleet.urls() == [P1, D1]


async def test_cancelled_as_d_answers_closes_ds_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves (or a sibling prompt fails) just as D's answer opened: Task.cancel() then
    delivers CancelledError at the await whose future is already done. D's stream is closed and its
    outstanding count goes back to 0 (it stayed up for good: routing skew, a drain never done)."""
    original = flows._until_decoded_or_prefill_failed

    async def cancelled_as_d_answers(d_task: asyncio.Task, p_task: asyncio.Task) -> None:
        await original(d_task, p_task)
        assert d_task.done() and d_task.exception() is None  # D's stream is open: an OpenStream holding a BackendCall
        raise asyncio.CancelledError  # what Task.cancel() delivers at this await when it lands now

    monkeypatch.setattr(flows, "_until_decoded_or_prefill_failed", cancelled_as_d_answers)
    fleet = Fleet()
    async with running(tid_config(), fleet) as (app, client):
        resp = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
        await asyncio.sleep(0.05)
        d = app.state.proxy.decode.backends[0]
        outstanding = d.outstanding
    assert resp.status_code == 499
    assert fleet[D1].streams and fleet[D1].streams[0].closed, "D's response never closed: D keeps generating"
    assert outstanding == 0, f"D's outstanding stuck at {outstanding} (least_outstanding/prefix skew; /admin/drain never drains)"
