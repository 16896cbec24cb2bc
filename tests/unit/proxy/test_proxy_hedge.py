"""Hedged prefills: a P silent past the hedge delay gets a second P beside it; the first answer is used,
the other request cancelled; the delay adapts to the pool and a budget bounds the hedges."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from kv_connectors.proxy import hedge
from kv_connectors.proxy.backends import Backend
from kv_connectors.proxy.config import ConfigError, HedgeSettings, Role
from kv_connectors.proxy.errors import UpstreamFailure
from kv_connectors.proxy.flags import parse_args
from kv_connectors.proxy.hedge import HedgePolicy
from tests.unit.proxy.proxy_fakes import D1, KV_FROM_P, P1, P2, Fleet, config, metric_value, prefill_answer, running

pytestmark = pytest.mark.anyio


def _answers_as(engine: str):
    """A P whose kv_transfer_params name it, so D's body tells whose KV it was handed."""

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        out = prefill_answer("/v1/completions", body)
        out["kv_transfer_params"] = {**KV_FROM_P, "remote_engine_id": engine}
        return out

    return answer


def _fleet() -> Fleet:
    fleet = Fleet((P1, P2), (D1,))
    fleet[P1].answer, fleet[P2].answer = _answers_as("p1"), _answers_as("p2")
    return fleet


async def test_a_silent_p_is_hedged_on_another_and_the_first_answer_is_used(caplog: pytest.LogCaptureFixture) -> None:
    """P1 never answers (frozen, not yet evicted): after the hedge delay P2 gets the prompt too; its answer
    goes to D, P1's request is cancelled, and nothing counts as a failure or a retry."""
    fleet = _fleet()
    fleet[P1].hold = True
    cfg = config((P1, P2), prefill_timeout_s=30.0, hedge=HedgeSettings(after_s=0.1))
    with caplog.at_level(logging.INFO, logger="kv_connectors.proxy"):
        async with running(cfg, fleet) as (_, client):
            started = time.perf_counter()
            resp = await asyncio.wait_for(
                client.post("/v1/completions", json={"prompt": [1]}, headers={"X-Request-Id": "rid-h"}), 5
            )
            elapsed = time.perf_counter() - started
            text = (await client.get("/metrics")).text
            health = (await client.get("/health")).json()
    assert resp.status_code == 200, resp.text
    assert fleet.urls() == [P1, P2, D1] and fleet[P1].cancelled == 1 and elapsed < 2.0
    assert fleet.bodies("decode")[0]["kv_transfer_params"]["remote_engine_id"] == "p2"
    assert metric_value(text, "kvc_proxy_prefill_hedges_total", result="won") == 1
    assert metric_value(text, "kvc_proxy_retries_total", role="prefill") == 0
    assert [b["healthy"] for b in health["prefill"]] == [True, True] and health["prefill"][0]["outstanding"] == 0
    [line] = [r.getMessage() for r in caplog.records if "request rid-h " in r.getMessage()]
    assert f"P={P1},{P2} " in line and "retries=0" in line and line.endswith("hedge=won")


async def test_when_the_first_p_answers_first_the_hedge_is_cancelled() -> None:
    fleet = _fleet()
    fleet[P1].delay_s, fleet[P2].delay_s = 0.3, 3.0
    async with running(config((P1, P2), hedge=HedgeSettings(after_s=0.1)), fleet) as (_, client):
        resp = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": [1]}), 5)
        text = (await client.get("/metrics")).text
        health = (await client.get("/health")).json()
    assert resp.status_code == 200
    assert fleet.urls() == [P1, P2, D1] and fleet[P2].cancelled == 1
    assert [(b["served"], b["failures"], b["outstanding"]) for b in health["prefill"]] == [
        (1, 0, 0),
        (0, 0, 0),
    ]  # cancelled: no failure
    assert fleet.bodies("decode")[0]["kv_transfer_params"]["remote_engine_id"] == "p1"
    assert metric_value(text, "kvc_proxy_prefill_hedges_total", result="lost") == 1


async def test_a_failed_hedge_leaves_the_first_p_to_answer() -> None:
    fleet = _fleet()
    fleet[P1].delay_s, fleet[P2].status = 0.4, 500
    async with running(config((P1, P2), hedge=HedgeSettings(after_s=0.1)), fleet) as (_, client):
        resp = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": [1]}), 5)
    assert resp.status_code == 200 and fleet.urls() == [P1, P2, D1] and fleet[P1].cancelled == 0
    assert fleet.bodies("decode")[0]["kv_transfer_params"]["remote_engine_id"] == "p1"


async def test_an_evicted_p_is_left_while_its_hedge_runs() -> None:
    fleet = _fleet()
    fleet[P1].hold = True
    fleet[P2].delay_s = 0.5
    async with running(config((P1, P2), unhealthy_after=1, hedge=HedgeSettings(after_s=0.05)), fleet) as (app, client):
        request = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": [1]}))
        while fleet[P2].started == 0:
            await asyncio.sleep(0.01)
        fleet[P1].health = False
        await app.state.health_checker.check_once()
        await asyncio.sleep(0.05)
        assert fleet[P1].cancelled == 1  # left at once, the hedge still running
        resp = await asyncio.wait_for(request, 5)
    assert resp.status_code == 200 and fleet.urls() == [P1, P2, D1]
    assert fleet.bodies("decode")[0]["kv_transfer_params"]["remote_engine_id"] == "p2"


async def test_the_adaptive_delay_waits_for_the_pools_usual_time_then_hedges() -> None:
    """auto: no hedge before min_samples answers; then a prefill silent for `factor` x the p90 is hedged."""
    fleet = _fleet()
    fleet[P1].delay_s, fleet[P2].delay_s = 0.2, 0.05
    hedge = HedgeSettings(min_samples=4, factor=2.0, floor_s=0.01, budget=0.5)
    async with running(config((P1, P2), hedge=hedge), fleet) as (app, client):
        assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
        assert fleet.urls() == [P1, D1]  # slow, but no answer seen yet: the pool's usual time is unknown
        fleet[P1].delay_s = 0.05
        for _ in range(4):
            assert (await client.post("/v1/completions", json={"prompt": [1]})).status_code == 200
        delay = app.state.proxy.hedge.delay_s()
        assert delay is not None and 0.09 <= delay < 0.5, delay  # 2 x the p90 of 0.05-0.2 s answers
        fleet[P1].hold = True
        for _ in range(2):  # round robin: P1's next turn within two requests
            fleet.calls.clear()
            started = time.perf_counter()
            assert (await asyncio.wait_for(client.post("/v1/completions", json={"prompt": [1]}), 5)).status_code == 200
            if fleet.urls()[0] == P1:
                break
        elapsed = time.perf_counter() - started
    assert fleet.urls() == [P1, P2, D1] and fleet[P1].cancelled == 1 and elapsed < 1.5


async def test_off_never_hedges() -> None:
    fleet = _fleet()
    fleet[P1].hold = True
    async with running(config((P1, P2), prefill_timeout_s=0.5, hedge=HedgeSettings(enabled=False, after_s=0.05)), fleet) as (_, c):
        resp = await c.post("/v1/completions", json={"prompt": [1]})
        text = (await c.get("/metrics")).text
    assert resp.status_code == 200 and fleet.urls() == [P1, P2, D1]  # P2 after P1's timeout: a retry
    assert metric_value(text, "kvc_proxy_retries_total", role="prefill") == 1
    assert metric_value(text, "kvc_proxy_prefill_hedges_total", result="won") == 0


def test_the_budget_bounds_the_share_of_hedges() -> None:
    policy = HedgePolicy(HedgeSettings(budget=0.1, window=1000))
    hedges = 0
    for _ in range(100):
        policy.started(hedge=False)
        if policy.may_hedge():
            policy.started(hedge=True)
            hedges += 1
    assert hedges == 11  # a tenth of the 100 prefills, and the one a new fleet may have


_P1, _P2 = Backend(Role.PREFILL, P1), Backend(Role.PREFILL, P2)


async def _race(policy: HedgePolicy, timeout_s: float) -> hedge.Won[str] | None:
    """A race whose first P never answers and whose hedge (P2) answers at once; None: no answer in time."""

    async def run(backend: Backend) -> str:
        if backend is _P1:
            await asyncio.Event().wait()
        return backend.url

    def failed(backend: Backend, failure: UpstreamFailure) -> None:
        raise AssertionError(failure)

    try:
        return await asyncio.wait_for(hedge.race(_P1, run, policy, lambda: _P2, lambda b: True, failed), timeout_s)
    except asyncio.TimeoutError:
        return None


async def test_a_silent_p_is_hedged_outside_the_budget() -> None:
    """A P that a hedge beat, with no answer of its own since (frozen), has each prefill hedged even with
    the budget spent: the hedge is not extra work when the first request is not served."""
    policy = HedgePolicy(HedgeSettings(after_s=0.02, budget=0.01))
    first = await _race(policy, 1.0)
    assert first is not None and first.by_hedge and policy.silent(_P1)  # the new fleet's one hedge beat P1
    policy.answered(_P1, 0.1)  # P1 answers another prompt: alive
    assert not policy.silent(_P1) and await _race(policy, 0.3) is None  # budget spent: no hedge
    policy.beaten(_P1)
    for _ in range(5):
        won = await _race(policy, 1.0)
        assert won is not None and won.backend is _P2 and won.by_hedge
    policy.answered(_P1, 0.1)
    assert not policy.silent(_P1) and await _race(policy, 0.3) is None


async def test_a_hedge_leaves_the_round_robin_turn_where_it_was() -> None:
    """P1's prompt hedged on P2: the next prompt still goes to P2 first (P2's turn), not back to P1."""
    fleet = _fleet()
    fleet[P1].hold = True
    async with running(config((P1, P2), hedge=HedgeSettings(after_s=0.05)), fleet) as (_, client):
        for _ in range(2):
            assert (await asyncio.wait_for(client.post("/v1/completions", json={"prompt": [1]}), 5)).status_code == 200
    assert fleet.urls() == [P1, P2, D1, P2, D1]


def test_the_delay_is_a_multiple_of_the_p90_with_a_floor() -> None:
    policy = HedgePolicy(HedgeSettings(min_samples=10, factor=2.0, floor_s=0.25))
    for _ in range(9):
        policy.answered(_P1, 0.5)
    assert policy.delay_s() is None
    policy.answered(_P1, 0.5)
    assert policy.delay_s() == pytest.approx(1.0)
    fast = HedgePolicy(HedgeSettings(min_samples=1, factor=2.0, floor_s=0.25))
    fast.answered(_P1, 0.01)
    assert fast.delay_s() == 0.25
    assert HedgePolicy(HedgeSettings(after_s=0.7)).delay_s() == 0.7


@pytest.mark.parametrize(
    "flags, want",
    [
        ([], HedgeSettings()),
        (["--hedge-prefill", "off"], HedgeSettings(enabled=False)),
        (["--hedge-prefill", "0.5", "--hedge-budget", "0.2"], HedgeSettings(after_s=0.5, budget=0.2)),
    ],
)
def test_the_flags(flags: list[str], want: HedgeSettings) -> None:
    assert parse_args(["--prefill", P1, "--decode", D1, *flags]).hedge == want


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hedge-prefill", "soon"], "--hedge-prefill must be auto, off or a number of seconds > 0"),
        (["--hedge-prefill", "0"], "--hedge-prefill must be auto, off or a number of seconds > 0"),
        (["--hedge-budget", "0"], "--hedge-budget must be in (0, 1]"),
        (["--hedge-budget", "1.5"], "--hedge-budget must be in (0, 1]"),
    ],
)
def test_bad_flags_are_refused(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--prefill", P1, "--decode", D1, *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ConfigError):
        HedgeSettings(budget=0)
