"""The load benchmark reads what the proxy and D really log: the proxy's line per request (its Trace) and
D's line per KV load (an engine pull over the memory transport), so a changed log format fails here."""

from __future__ import annotations

import logging

import pytest

from benchmarks.faults.bench_load import ProxyLine, after_ok, breakdown, load_phases, proxy_lines
from kv_connectors.proxy.config import Role
from kv_connectors.proxy.metrics import ProxyMetrics
from kv_connectors.proxy.trace import Trace
from tests.unit.engine.engine_harness import Cluster


def test_the_proxy_line_of_a_retried_request_is_read_back(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kv_connectors.proxy")
    trace = Trace("abc123", "/v1/completions", ProxyMetrics())
    trace.chose(Role.PREFILL, "http://p1")
    trace.chose(Role.DECODE, "http://d2")
    trace.failed(Role.DECODE, "http://d2")
    trace.chose(Role.DECODE, "http://d1")
    trace.retries = 1
    trace.prefill_answered()
    trace.finish(200)
    (line,) = proxy_lines(caplog.text)
    assert (line.request_id, line.retries, line.prefill, line.decode, line.outcome) == (
        "abc123",
        1,
        "http://p1",
        "http://d2!,http://d1",
        "ok",
    )
    assert line.p_answer_s is not None and line.d_first_s is None and line.total_s >= line.p_answer_s
    assert line.hedge == "-"


def test_a_hedged_prefill_is_read_back(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kv_connectors.proxy")
    trace = Trace("h1", "/v1/completions", ProxyMetrics())
    trace.chose(Role.PREFILL, "http://p2")
    trace.chose(Role.PREFILL, "http://p1")
    trace.chose(Role.DECODE, "http://d1")
    trace.hedge = "won"
    trace.finish(200)
    (line,) = proxy_lines(caplog.text)
    assert (line.prefill, line.hedge) == ("http://p2,http://p1", "won")


def test_ds_load_line_is_read_back_with_its_phases(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kv_connectors")
    c = Cluster()
    c.prefill_done("r1", (1, 2))
    Cluster.recv(c.d, "cmpl-abc123-0", "r1", (5, 6), (1, 2))
    c.run(30)
    assert c.d.finished_recving == {"cmpl-abc123-0"}
    phases = load_phases(caplog.text)
    assert set(phases) == {"cmpl-abc123-0"}
    assert {"queue_ms", "handshake_ms", "read_ms", "total_ms", "transfer_ms"} <= set(phases["cmpl-abc123-0"])

    names = {"http://p1": "P1", "http://d1": "D1"}
    line = ProxyLine("abc123", 0.5, 0.1, 0.3, 0, "http://p1", "http://d1", "ok")
    summary = breakdown([line], phases, names)
    assert summary["d_load_ms"]["handshake_ms"] == phases["cmpl-abc123-0"]["handshake_ms"]
    assert summary["backends_used"] == {"P1": 1, "D1": 1} and summary["p_answer_to_d_first_byte_s"] == 0.2


def test_the_fleet_recovered_only_if_the_restarted_d_served_and_every_side_channel_answered() -> None:
    good = {
        "requests": 48,
        "wrong": 0,
        "lost": 0,
        "errors": 0,
        "served_by_restarted_d2": 9,
        "side_channels": {"P1": "answered (engine a)", "D2": "answered (engine b)"},
    }
    assert after_ok(good)
    assert not after_ok({**good, "served_by_restarted_d2": 0})
    assert not after_ok({**good, "wrong": 1})
    assert not after_ok({**good, "lost": 1})
    assert not after_ok({**good, "side_channels": {"P1": "answered (engine a)", "D2": "no answer: within 10 s"}})
