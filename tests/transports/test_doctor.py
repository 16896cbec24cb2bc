"""`kv-connectors doctor` on this host: facts that agree with the host, a measured probe per path
(real NIXL and Mooncake between two processes), a recommendation, and a configuration that cannot
work here refused with exit status 2."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from pathlib import Path

from kv_connectors import doctor
from kv_connectors.doctor.peerprobe import SERVING
from kvc_testing.procs import ManagedProcess, free_port

IB = Path("/sys/class/infiniband")


def _doctor(*args: str, timeout: float = 300) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "kv_connectors", "doctor", "--json", *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)  # the whole of stdout: engine logs never reach it


def test_doctor_reports_this_host_measures_every_path_and_recommends():
    code, r = _doctor()
    assert code == 0, r
    rdma = sorted(p.name for p in IB.iterdir()) if IB.is_dir() else []
    assert r["devices"]["rdma_devices"] == rdma
    assert bool(r["devices"]["gpus"]) == any(Path("/dev").glob("nvidia[0-9]*"))
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    assert f"[{r['thp']}]" in thp
    assert r["versions"]["kv-connectors"] and r["versions"]["nixl"] and r["versions"]["mooncake-transfer-engine-non-cuda"]
    rec = r["recommendation"]
    assert set(r["probe"]) == {"nixl", "mooncake", f"{rec['transport']}+staged"}  # staged: the fastest only
    for path in r["probe"]:
        assert "error" not in r["probe"][path], (path, r["probe"][path])
        assert r["probe"][path]["read_gbps"] > 0 and r["probe"][path]["write_gbps"] > 0, path
    assert rec["transport"] in ("nixl", "mooncake") and rec["mode"] in ("pull", "push", "either")
    assert rec["kv_transfer_config"]["decode"]["kv_role"] == "kv_consumer"
    best = r["probe"][rec["transport"]]  # no other transport reads faster beyond the margin, in every round
    assert not any(doctor.beats(p["read_rounds"], best["read_rounds"]) for k, p in r["probe"].items() if "+" not in k)
    tcp_warning = any("no RDMA device" in w for w in rec["warnings"])
    assert tcp_warning == (not rdma)
    if not rdma:
        assert r["ucx"]["across_hosts"].startswith("tcp")
    # What UCX itself chose between the probe's two processes (UCX_PROTO_INFO), not a deduction:
    # cma on this host, the answer that "within a host" reports.
    selected = r["ucx"]["selected"]
    assert "error" not in selected, selected
    assert "cma/memory" in selected["read"] and "cma/memory" in selected["write"], selected
    assert r["ucx"]["within_host"].startswith("READ cma/memory") and "asked of UCX" in r["ucx"]["within_host"]
    assert not any("over the network" in w for w in rec["warnings"])


def test_doctor_asks_ucx_and_sees_tcp_when_ucx_tls_allows_only_tcp(monkeypatch):
    """With UCX_TLS=tcp two processes of this host move data over TCP: UCX says so and the doctor
    warns (the trap of a container without cma: P and D on one host at TCP speed)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    selected = doctor.ucx_selection()
    assert selected.get("read") and selected.get("write"), selected
    assert all(lane.startswith("tcp/") for op in ("read", "write", "messages") for lane in selected[op]), selected


def test_doctor_refuses_a_config_that_cannot_work_here():
    rdma = IB.is_dir() and any(IB.iterdir())
    config = {
        "kv_connector": "MooncakeConnector",
        "kv_connector_module_path": "kv_connectors.mooncake",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake_protocol": "rdma", "side_channel_port": 5999},
    }
    code, r = _doctor("--no-probe", "--config", json.dumps(config), timeout=120)
    assert r["probe"] == {}
    if rdma:
        assert code == 0 and r["config_problems"] == []
    else:
        assert code == 2 and any("needs an RDMA device" in p for p in r["config_problems"]), r["config_problems"]
    spin = {**config, "kv_connector": "NixlConnector", "kv_connector_module_path": "kv_connectors.nixl"}
    spin["kv_connector_extra_config"] = {"progress_delay_us": 0, "side_channel_port": 5999}
    code, r = _doctor("--no-probe", "--config", json.dumps(spin), timeout=120)
    assert code == 2 and any("spin" in p for p in r["config_problems"])


def _server(host: str, port: int, *wrap: str) -> ManagedProcess:
    argv = [*wrap, sys.executable, "-m", "kv_connectors", "doctor", "--serve", f"{host}:{port}", "--serve-s", "240"]
    server = ManagedProcess(argv, name="doctor-serve")
    server.start()
    server.wait_log(SERVING, 60)
    return server


def test_doctor_asks_ucx_through_a_doctor_serve_and_survives_a_hostile_client(monkeypatch):
    """`doctor --peer HOST:PORT` against a `doctor --serve` (real NIXL, two processes): UCX's own
    answer (tcp under UCX_TLS=tcp, with the TCP warning) and the GB/s it moved, bytes verified; a client
    that announces a huge frame or sends garbage is dropped and the server answers the next probe."""
    port = free_port()
    with _server("127.0.0.1", port) as server:
        monkeypatch.setenv("UCX_TLS", "tcp")
        code, r = _doctor("--no-probe", "--peer", f"127.0.0.1:{port}", timeout=120)
        assert code == 0, r
        (peer,) = r["peers"]
        asked = peer["asked"]
        assert asked["read"] and all(lane.startswith("tcp/") for lane in asked["read"] + asked["write"]), asked
        assert asked["read_gbps"] > 0 and asked["write_gbps"] > 0 and asked["descriptors"] > 1, asked
        assert "asked of UCX through the doctor --serve" in peer["transport"], peer
        assert any("go over TCP (UCX chose tcp/" in w for w in r["recommendation"]["warnings"]), r["recommendation"]
        for junk in (struct.pack("!I", 1 << 30), b"\x00\x00\x00\x05garbage", b""):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(junk)
        monkeypatch.delenv("UCX_TLS")
        code, r = _doctor("--no-probe", "--peer", f"127.0.0.1:{port}", timeout=120)
        assert code == 0 and r["peers"][0]["asked"]["read"] == ["cma/memory"], r["peers"]
        assert server.is_running(), server.log_tail()
    code, r = _doctor("--no-probe", "--peer", f"127.0.0.1:{port}", timeout=120)  # nobody serves there now
    assert code == 2 and "cannot reach a `doctor --serve`" in r["peers"][0]["error"], r["peers"]
