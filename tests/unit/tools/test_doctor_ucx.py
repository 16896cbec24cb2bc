"""The doctor asks UCX what it chose (UCX_PROTO_INFO tables) and warns when two processes of one host
move data over the network. Table text as UCX 1.19 (nixl 1.5.1) logs it; tests/transports/test_doctor.py
asks the real UCX."""

from __future__ import annotations

from typing import Any

from kv_connectors import doctor
from kv_connectors.doctor import peers

PREFIX = "[1796186612.061764] [vm:32167:0]   "
TABLES = """\
+--------+-------------+-------------------------------------------+
| doctor-self intra-node cfg#1                                     |
| remote memory read by ucp_get*(multi) into host memory from host |
+--------+-------------+-------------------------------------------+
| Range  | Description |                  Config                   |
+--------+-------------+-------------------------------------------+
| 0..inf | zero-copy   | cma/memory                                |
+--------+-------------+-------------------------------------------+
| doctor-self intra-node cfg#1                                    |
| remote memory write by ucp_put*(multi) from host memory to host |
+--------+-------------+------------------------------------------+
| 0..8184 | short       | tcp/lo                                  |
| 8185..inf | zero-copy   | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
+--------+-------------+------------------------------------------+
| doctor-self intra-node cfg#1                                  |
| remote memory read by ucp_get* into cuda memory from host     |
| 0..inf | zero-copy   | cuda_copy/cuda                          |
| doctor-self self cfg#0                            |
| active message by ucp_am_send* from host memory   |
| Range | Description | Config |
|          0 | short              | tcp/lo        |
|   1..16515 | zero-copy          | tcp/lo        |
"""
LOG = "".join(PREFIX + line + "\n" for line in TABLES.splitlines()) + "[1796186612.1] [vm:1:0] some other log line\n"


def test_proto_info_tables_parse_into_the_lanes_of_each_operation() -> None:
    chosen = doctor.parse_proto_info(LOG)
    assert chosen == {
        "read": ["cma/memory"],  # the CUDA-memory table is not ours
        "write": ["tcp/lo", "rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"],
        "messages": ["tcp/lo"],
    }
    assert doctor.parse_proto_info("no tables at all") == {"read": [], "write": [], "messages": []}


def _report(selected: dict[str, Any]) -> dict[str, Any]:
    dev = {"gpus": [], "rdma_devices": [], "gpudirect_rdma": False, "nics": ["eth0"]}
    probe = {"nixl": {"read_gbps": 2.0, "write_gbps": 2.0}}
    ucx = {"env": {}, "within_host": "x", "across_hosts": "tcp", "selected": selected}
    return {"devices": dev, "probe": probe, "known_problems": [], "ucx": ucx, "thp": "madvise"}


def test_a_host_whose_processes_talk_over_tcp_is_warned_about() -> None:
    tcp = {"read": ["tcp/lo"], "write": ["tcp/lo"], "messages": ["tcp/lo"]}
    warnings = doctor.recommend(_report(tcp))["warnings"]
    assert any("between two processes of this host over the network (tcp/lo)" in w for w in warnings), warnings
    for fine in ({"read": ["cma/memory"], "write": ["cma/memory"], "messages": ["tcp/lo"]}, {"error": "no UCX"}, {}):
        assert not any("over the network" in w for w in doctor.recommend(_report(fine))["warnings"]), fine


def test_a_peer_on_this_host_gets_the_answer_ucx_gave(monkeypatch) -> None:
    monkeypatch.setattr(peers, "route", lambda address: {"type": "local", "dev": "lo"})
    dev = {"gpus": [], "rdma_devices": [], "gpudirect_rdma": False, "nics": ["eth0"]}
    asked = "READ tcp/lo, WRITE tcp/lo (asked of UCX: UCX_PROTO_INFO)"
    assert doctor.peer_path("127.0.0.1", dev, {}, asked)["transport"] == asked
    assert doctor.peer_path("127.0.0.1", dev, {})["transport"].startswith("cma/shm")  # not asked: deduced
