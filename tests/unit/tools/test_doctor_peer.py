"""`doctor --peer HOST`: the interface the kernel routes through and what UCX will use to reach
the peer there, with warnings for the traps (TCP, a UCX_NET_DEVICES that leaves the interface out).
The routing table and sysfs are faked here; tests/e2e/test_two_hosts.py runs it across namespaces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kv_connectors import doctor
from kv_connectors.doctor import facts, peers

NO_GPU = {"gpus": [], "rdma_devices": [], "gpudirect_rdma": False, "nics": ["eth0", "ib0"]}


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """eth0 (no RDMA) and ib0 (mlx5_0 behind it); 10.0.0.0/8 via eth0, 192.168.0.0/16 via ib0."""
    (tmp_path / "class" / "net" / "eth0" / "device").mkdir(parents=True)
    (tmp_path / "class" / "net" / "ib0" / "device" / "infiniband" / "mlx5_0").mkdir(parents=True)
    monkeypatch.setattr(facts, "SYS", tmp_path)
    routes = {
        "127.0.0.1": {"type": "local", "dev": "lo"},
        "10.1.2.3": {"dev": "eth0", "gateway": "10.0.0.1"},
        "192.168.1.7": {"dev": "ib0"},
    }

    def route(address: str) -> dict[str, Any]:
        return dict(routes[address]) if address in routes else {"error": f"no route to {address}: Network is unreachable"}

    monkeypatch.setattr(peers, "route", route)
    return routes


def test_a_peer_on_this_host_is_reached_through_shared_memory(host: dict[str, Any]) -> None:
    p = doctor.peer_path("127.0.0.1", NO_GPU, {})
    assert p["interface"] == "lo" and p["transport"].startswith("cma/shm") and p["warnings"] == []


def test_a_peer_behind_a_nic_without_rdma_is_reached_over_tcp_with_a_warning(host: dict[str, Any]) -> None:
    p = doctor.peer_path("10.1.2.3", NO_GPU, {})
    assert p["transport"] == "tcp over eth0"
    assert p["rdma_devices"] == []
    assert any("go over TCP" in w and "eth0 has no RDMA device" in w for w in p["warnings"]), p["warnings"]


def test_a_peer_behind_an_rdma_nic_is_reached_over_rdma_unless_ucx_tls_leaves_it_out(host: dict[str, Any]) -> None:
    p = doctor.peer_path("192.168.1.7", NO_GPU, {})
    assert p["transport"] == "rc/ud over mlx5_0 (behind ib0)" and p["warnings"] == []
    p = doctor.peer_path("192.168.1.7", NO_GPU, {"UCX_TLS": "tcp"})
    assert p["transport"] == "tcp over ib0"
    assert any("UCX_TLS=tcp leaves mlx5_0 out" in w for w in p["warnings"]), p["warnings"]


@pytest.mark.parametrize(
    ("tls", "rdma"),
    [
        ("", True),
        ("all", True),
        ("rc,sm", True),
        ("^tcp", True),
        ("^rc", True),
        ("tcp", False),
        ("^rc,ud,dc", False),
        ("^ib", False),
    ],
)
def test_ucx_tls_lists_and_exclusions(tls: str, rdma: bool, host: dict[str, Any]) -> None:
    p = doctor.peer_path("192.168.1.7", NO_GPU, {"UCX_TLS": tls} if tls else {})
    assert p["transport"].startswith("rc/ud") == rdma, (tls, p)


def test_ucx_net_devices_without_the_interface_that_reaches_the_peer_is_called_out(host: dict[str, Any]) -> None:
    p = doctor.peer_path("10.1.2.3", NO_GPU, {"UCX_NET_DEVICES": "lo"})
    assert any("UCX_NET_DEVICES=lo does not include eth0" in w for w in p["warnings"]), p["warnings"]
    for ok in ("eth0", "all", "mlx5_1:1,eth0"):
        p = doctor.peer_path("10.1.2.3", NO_GPU, {"UCX_NET_DEVICES": ok})
        assert not any("UCX_NET_DEVICES" in w for w in p["warnings"]), (ok, p["warnings"])
    p = doctor.peer_path("192.168.1.7", NO_GPU, {"UCX_NET_DEVICES": "mlx5_0:1"})  # the RDMA device's name counts
    assert not any("UCX_NET_DEVICES" in w for w in p["warnings"]), p["warnings"]


def test_an_unreachable_or_unresolvable_peer_is_an_error(host: dict[str, Any]) -> None:
    assert "no route to 172.16.0.9" in doctor.peer_path("172.16.0.9", NO_GPU, {})["error"]
    assert "cannot resolve" in doctor.peer_path("no-such-host.invalid", NO_GPU, {})["error"]


def test_peers_reach_the_report_its_warnings_and_the_exit_status(host: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from kv_connectors import cli

    report = doctor.diagnose(probe_paths=False, peers=["10.1.2.3"])
    assert [p["transport"] for p in report["peers"]] == ["tcp over eth0"]
    assert any("transfers to 10.1.2.3 go over TCP" in w for w in report["recommendation"]["warnings"])
    assert "peer 10.1.2.3 (10.1.2.3): via eth0, UCX will use tcp over eth0" in doctor.render(report)
    assert cli.main(["doctor", "--no-probe", "--peer", "10.1.2.3"]) == 0
    assert cli.main(["doctor", "--no-probe", "--peer", "10.1.2.3", "--peer", "172.16.0.9"]) == 2
    assert "peer 172.16.0.9: FAILED: no route to 172.16.0.9" in capsys.readouterr().out


def test_the_real_routing_table_answers_for_loopback() -> None:
    r = doctor.route("127.0.0.1")
    assert r.get("type") == "local" and r.get("dev") == "lo", r
