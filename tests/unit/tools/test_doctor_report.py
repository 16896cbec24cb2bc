"""`kv-connectors doctor`'s output without engines: stdout is the report alone (one JSON object with
--json; engine output dropped, or on stderr with -v), and a recommendation that is a paste-able
--kv-transfer-config and does not flip with noise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kv_connectors import checks, cli, doctor
from kv_connectors.doctor import command

CHATTER = "ENGINE CHATTER"


def _fake_probes(read: list[float], write: list[float]) -> dict[str, dict[str, Any]]:
    def result(r: list[float], w: list[float]) -> dict[str, Any]:
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        return {"read_gbps": med(r), "write_gbps": med(w), "read_rounds": r, "write_rounds": w, "descriptors": 2048}

    return {
        "nixl": result(read, write),
        "nixl+staged": result([0.2, 0.2, 0.2], [0.2, 0.2, 0.2]),
        "mooncake": result([0.1, 0.1, 0.1], [0.1, 0.1, 0.1]),
    }


@pytest.fixture
def chattering_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probes that print as NIXL (Python logger on stdout), UCX and glog (C, stderr) and a child do."""

    def probe_all() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        print(f"{CHATTER}: python stdout", flush=True)
        os.write(1, f"{CHATTER}: fd 1\n".encode())
        os.write(2, f"{CHATTER}: fd 2\n".encode())
        subprocess.run([sys.executable, "-c", f"import sys; print('{CHATTER}: child'); print('x', file=sys.stderr)"], check=True)
        selected = {"read": ["cma/memory"], "write": ["cma/memory"], "messages": ["tcp/lo"]}
        return _fake_probes([2.0, 2.2, 1.8], [2.1, 1.9, 2.4]), selected

    monkeypatch.setattr(command, "probe_all", probe_all)


def test_json_is_the_whole_of_stdout_and_engine_output_is_dropped(
    chattering_engines: None, capfd: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["doctor", "--json"]) == 0
    out, err = capfd.readouterr()
    report = json.loads(out)  # exactly one JSON object: anything else on stdout fails here
    assert report["recommendation"]["transport"] == "nixl" and CHATTER not in out + err


def test_verbose_sends_engine_output_to_stderr(chattering_engines: None, capfd: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--json", "-v"]) == 0
    out, err = capfd.readouterr()
    json.loads(out)
    assert err.count(CHATTER) == 4, err


def test_the_text_report_comes_first(chattering_engines: None, capfd: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor"]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("versions: ") and CHATTER not in out + err
    assert "['" not in out and "{'" not in out  # plain words, not Python reprs
    assert "  P: " in out and "  D: " in out and out.rstrip().splitlines()[-1].startswith("(doctor took ")


def _pasted(rendered: str, side: str) -> dict[str, Any]:
    line = next(line for line in rendered.splitlines() if line.startswith(f"  {side}: "))
    config: dict[str, Any] = json.loads(line.split("--kv-transfer-config '", 1)[1].rstrip("'"))
    return config


def _report(read: list[float], write: list[float]) -> dict[str, Any]:
    dev = {"gpus": [], "rdma_devices": [], "gpudirect_rdma": False, "nics": ["eth0"]}
    ucx = {"env": {}, "within_host": "x", "across_hosts": "tcp", "selected": {}}
    report = {
        "versions": {},
        "devices": dev,
        "probe": _fake_probes(read, write),
        "known_problems": [],
        "ucx": ucx,
        "thp": "madvise",
    }
    report["recommendation"] = doctor.recommend(report)
    return report


@pytest.mark.parametrize(
    ("read", "write", "mode"),
    [
        ([2.0, 1.0, 2.1], [3.3, 3.4, 1.4], "either"),  # WRITE's median is 2.4x READ's, but one round says otherwise
        ([1.0, 1.1, 0.9], [1.5, 1.6, 1.4], "either"),  # within the margin
        ([1.0, 1.1, 0.9], [1.8, 1.9, 1.7], "push"),  # every round of WRITE beats every READ by over 1.5x
        ([2.0, 2.1, 1.9], [1.0, 1.1, 0.9], "pull"),
    ],
)
def test_the_mode_needs_a_margin_in_every_round(read: list[float], write: list[float], mode: str) -> None:
    rec = _report(read, write)["recommendation"]
    assert rec["mode"] == mode, rec["mode_why"]
    d_extra = rec["kv_transfer_config"]["decode"]["kv_connector_extra_config"]
    assert d_extra.get("mode") == ("push" if mode == "push" else None)  # either: the transport's default


@pytest.mark.parametrize("write", [[1.0, 1.1, 0.9], [1.8, 1.9, 1.7]])
def test_the_recommendation_pastes_into_vllm_and_check_config(write: list[float]) -> None:
    rendered = doctor.render(_report([1.0, 1.1, 0.9], write))
    p, d = _pasted(rendered, "P"), _pasted(rendered, "D")
    for config, role in ((p, "kv_producer"), (d, "kv_consumer")):
        checked = checks.check_transfer_config(config)  # vLLM's KVTransferConfig, then ours
        assert checked.kind == "nixl" and checked.config.role.value == role and checked.warnings == ()
    assert p["kv_connector_extra_config"]["side_channel_port"] != d["kv_connector_extra_config"]["side_channel_port"]


def test_a_path_that_raises_is_reported_and_the_others_still_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's own exception (not ours) in one path: that path's error, not a doctor without a report;
    `then` names more paths from the results so far, probed with the same peer process."""
    from kv_connectors.doctor import local_probe

    def probe_path(conn: Any, kind: str, staged: bool, *args: Any) -> dict[str, Any]:
        if staged and kind == "nixl":
            raise TypeError("an engine changed its signature")
        return {"read_gbps": 1.0 if kind == "nixl" else 0.1, "write_gbps": 1.0}

    monkeypatch.setattr(local_probe, "_probe_path", probe_path)
    seen: list[set[str]] = []

    def then(done: dict[str, dict[str, Any]]) -> list[tuple[str, bool]]:
        seen.append(set(done))
        return [("mooncake", True)]

    out = local_probe.probe_local([("nixl", True), ("nixl", False)], then=then)
    assert out["nixl+staged"] == {"error": "TypeError: an engine changed its signature"}
    assert out["nixl"]["read_gbps"] == 1.0 and out["mooncake+staged"]["read_gbps"] == 0.1
    assert seen == [{"nixl", "nixl+staged"}]
