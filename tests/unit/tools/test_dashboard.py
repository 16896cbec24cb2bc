"""The example Grafana dashboard loads and is well formed (the e2e suite checks its metrics exist)."""

from __future__ import annotations

from kvc_testing import dashboard


def test_dashboard_structure():
    d = dashboard.load()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for p in d["panels"]:
        assert p["type"] == "timeseries" and p["title"] and p["targets"], p
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"])
        assert all(t["expr"].count("(") == t["expr"].count(")") for t in p["targets"]), p["title"]


def test_dashboard_queries_every_phase_and_the_proxy():
    names = dashboard.sample_names(dashboard.load())
    for phase in ("load_queue", "load_handshake", "load_claim", "load_read", "load_total", "lease_hold"):
        assert f"kvc:{phase}_seconds_bucket" in names, phase
    assert {"kvc_proxy_ttft_seconds_bucket", "kvc_proxy_requests_total", "kvc:recv_failures_total"} <= names
