"""The admin endpoints: token checks, add, remove, drain (in-flight requests finish, no new ones), undrain."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kv_connectors.proxy.flags import parse_args
from tests.unit.proxy.proxy_fakes import D1, D2, P1, P2, Fleet, config, metric_value, running, tid_config

pytestmark = pytest.mark.anyio
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _health(client: httpx.AsyncClient) -> dict:
    return (await client.get("/health")).json()


@pytest.mark.parametrize(
    "token, headers, status, words",
    [
        ("", AUTH, 403, "admin endpoints are off"),
        (TOKEN, {}, 401, "missing admin token"),
        (TOKEN, {"Authorization": TOKEN}, 401, "missing admin token"),
        (TOKEN, {"Authorization": "Bearer wrong"}, 403, "wrong admin token"),
        (TOKEN, {"Authorization": f"Bearer {TOKEN}x"}, 403, "wrong admin token"),
    ],
)
async def test_admin_refuses_without_the_token_and_changes_nothing(token: str, headers: dict, status: int, words: str) -> None:
    fleet = Fleet()
    async with running(config(admin_token=token), fleet) as (_, client):
        for method, path, body in (
            ("POST", "/admin/backends", {"role": "prefill", "url": P2}),
            ("DELETE", "/admin/backends", {"role": "prefill", "url": P1}),
            ("POST", "/admin/drain", {"role": "decode", "url": D1}),
        ):
            resp = await client.request(method, path, json=body, headers=headers)
            assert resp.status_code == status and words in resp.json()["error"]["message"], resp.text
        health = await _health(client)
    assert [b["url"] for b in health["prefill"]] == [P1] and not health["decode"][0]["draining"]


def test_admin_token_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVC_PROXY_ADMIN_TOKEN", "abc")
    monkeypatch.setenv("MY_TOKEN", "xyz")
    assert parse_args(["--prefill", "p:1", "--decode", "d:2"]).admin_token == "abc"
    cfg = parse_args(["--prefill", "p:1", "--decode", "d:2", "--admin-token-env", "MY_TOKEN"])
    assert cfg.admin_token == "xyz" and "xyz" not in repr(cfg)


async def test_add_a_prefill_server_and_it_serves() -> None:
    fleet = Fleet((P1, P2), (D1,))
    cfg = config((P1,), admin_token=TOKEN)
    async with running(cfg, fleet) as (_, client):
        added = await client.post("/admin/backends", json={"role": "prefill", "url": "p2.test:8100/"}, headers=AUTH)
        assert added.status_code == 201 and added.json()["url"] == P2, added.text
        again = await client.post("/admin/backends", json={"role": "prefill", "url": P2}, headers=AUTH)
        assert again.status_code == 409
        for body, words in (
            ({"role": "prefill", "url": "ftp://x"}, "invalid backend URL"),
            ({"role": "router", "url": P2}, "'role'"),
            ({"role": "decode", "url": D2, "side_channel": "1:2"}, "no side channel"),
            ({"role": "prefill"}, "'url'"),
        ):
            resp = await client.post("/admin/backends", json=body, headers=AUTH)
            assert resp.status_code == 400 and words in resp.json()["error"]["message"], resp.text
        for _ in range(4):
            assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
        text = (await client.get("/metrics")).text
    assert sorted(u for u in fleet.urls() if u in (P1, P2)) == [P1, P1, P2, P2]
    assert metric_value(text, "kvc_proxy_fleet_changes_total", action="add") == 1
    assert metric_value(text, "kvc_proxy_backend_healthy", role="prefill", url=P2) == 1


async def test_transfer_id_flow_needs_a_side_channel_for_an_added_prefill() -> None:
    fleet = Fleet((P1, P2), (D1,))
    async with running(tid_config((P1,), admin_token=TOKEN), fleet) as (_, client):
        resp = await client.post("/admin/backends", json={"role": "prefill", "url": P2}, headers=AUTH)
        assert resp.status_code == 400 and "side_channel" in resp.json()["error"]["message"]
        resp = await client.post(
            "/admin/backends", json={"role": "prefill", "url": P2, "side_channel": "10.0.0.2:5600"}, headers=AUTH
        )
        assert resp.status_code == 201 and resp.json()["side_channel"] == "10.0.0.2:5600"


async def test_remove_a_backend_but_never_the_last_decode() -> None:
    fleet = Fleet((P1, P2), (D1,))
    async with running(config((P1, P2), admin_token=TOKEN), fleet) as (_, client):
        last = await client.request("DELETE", "/admin/backends", json={"role": "decode", "url": D1}, headers=AUTH)
        assert last.status_code == 409 and "last decode server" in last.json()["error"]["message"]
        gone = await client.request("DELETE", "/admin/backends", json={"role": "prefill", "url": P1}, headers=AUTH)
        assert gone.status_code == 200 and gone.json()["removed"] is True
        missing = await client.request("DELETE", "/admin/backends", json={"role": "prefill", "url": P1}, headers=AUTH)
        assert missing.status_code == 404
        for _ in range(3):
            assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
        health = await _health(client)
        text = (await client.get("/metrics")).text
    assert [u for u in fleet.urls() if u in (P1, P2)] == [P2, P2, P2]
    assert [b["url"] for b in health["prefill"]] == [P2]
    assert f'url="{P1}"' not in text  # its gauges went with it


async def test_drain_waits_for_in_flight_requests_and_sends_no_new_ones() -> None:
    fleet = Fleet((P1,), (D1, D2))
    fleet[D1].delay_s = 0.3
    async with running(config(decode=(D1, D2), admin_token=TOKEN), fleet) as (_, client):
        in_flight = asyncio.create_task(client.post("/v1/completions", json={"prompt": [1]}))  # to D1, slow
        while not fleet.bodies(D1):
            await asyncio.sleep(0.01)
        drain = asyncio.create_task(client.post("/admin/drain", json={"role": "decode", "url": D1, "timeout_s": 5}, headers=AUTH))
        await asyncio.sleep(0.05)
        health = await _health(client)
        assert health["decode"][0]["draining"] is True and health["status"] == "ok"
        for _ in range(3):  # while D1 drains, new requests go to D2
            assert (await client.post("/v1/completions", json={"prompt": [2]})).status_code == 200
        assert not drain.done()  # the request on D1 is still running
        report = (await drain).json()
        assert (await in_flight).status_code == 200  # the in-flight request finished
        assert report["drained"] is True and report["outstanding"] == 0 and report["waited_s"] >= 0.1
        fleet[D1].delay_s = 0
        for _ in range(2):
            await client.post("/v1/completions", json={"prompt": [3]})
        assert len(fleet.bodies(D1)) == 1  # still drained: nothing new
        undrained = await client.post("/admin/undrain", json={"role": "decode", "url": D1}, headers=AUTH)
        assert undrained.status_code == 200 and undrained.json()["draining"] is False
        for _ in range(2):
            await client.post("/v1/completions", json={"prompt": [4]})
        text = (await client.get("/metrics")).text
    assert len(fleet.bodies(D1)) == 2  # serves again
    assert metric_value(text, "kvc_proxy_fleet_changes_total", action="drain") == 1
    assert metric_value(text, "kvc_proxy_backend_draining", role="decode", url=D1) == 0


async def test_drain_deadline_reports_what_is_still_in_flight() -> None:
    fleet = Fleet((P1,), (D1, D2))
    fleet[D1].delay_s = 1.0
    async with running(config(decode=(D1, D2), admin_token=TOKEN), fleet) as (_, client):
        in_flight = asyncio.create_task(client.post("/v1/completions", json={"prompt": [1]}))
        while not fleet.bodies(D1):
            await asyncio.sleep(0.01)
        report = (await client.post("/admin/drain", json={"role": "decode", "url": D1, "timeout_s": 0.1}, headers=AUTH)).json()
        assert report["drained"] is False and report["outstanding"] == 1 and report["draining"] is True
        bad = await client.post("/admin/drain", json={"role": "decode", "url": D1, "timeout_s": -1}, headers=AUTH)
        assert bad.status_code == 400
        assert (await in_flight).status_code == 200


async def test_draining_every_prefill_falls_back_to_decode_alone() -> None:
    fleet = Fleet((P1,), (D1,))
    async with running(config(admin_token=TOKEN), fleet) as (_, client):
        await client.post("/admin/drain", json={"role": "prefill", "url": P1, "timeout_s": 0}, headers=AUTH)
        assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
    assert fleet.urls() == [D1]


async def test_a_removed_backend_leaves_no_metric_series() -> None:
    """Its request counters and latency go with it, and a request still in flight on it that fails
    later does not bring a healthy=0 series back (series grew with every URL ever removed)."""
    fleet = Fleet((P1, P2))
    async with running(config((P1, P2)), fleet) as (app, client):
        ctx = app.state.proxy
        p1 = ctx.prefill.find(P1)
        await client.post("/v1/completions", json={"prompt": [1]})
        ctx.prefill.remove(p1)
        ctx.prefill.mark_failed(p1, "a request in flight on it failed after its removal")
        text = (await client.get("/metrics")).text
    assert not [line for line in text.splitlines() if P1 in line and not line.startswith("#")]
