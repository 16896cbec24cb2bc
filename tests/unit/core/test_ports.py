"""Side-channel ports laid out as vLLM's built-in lays them out (one port per instance, plus the
data-parallel index; tensor-parallel ranks > 0 named by rank 0), the rank layout kept behind
`side_channel_ports`, check-config's check of each data-parallel engine's port, and the side-channel
addresses a peer sends checked. D finding P's ranks through rank 0: engine/test_engine_ranks.py."""

from __future__ import annotations

import pytest

from kv_connectors import sidechannel, wire
from kv_connectors.checks import host_problems
from kv_connectors.config import PortLayout, parse_config
from kv_connectors.errors import ConfigError, KVConnectorError
from kvc_testing.procs import free_port


# the layout -------------------------------------------------------------------------------------
def test_the_instance_layout_is_the_builtins() -> None:
    cfg = parse_config("e", "kv_producer", {"side_channel_port": 5600})
    assert cfg.side_channel_ports is PortLayout.INSTANCE
    assert [cfg.instance_port(dp, tp_size=2) for dp in range(3)] == [5600, 5601, 5602]
    assert [cfg.rank_port(r, 1, 2) for r in range(2)] == [5601, 0]  # 0: a port the system picks


def test_the_rank_layout_leaves_room_for_every_rank() -> None:
    cfg = parse_config("e", "kv_producer", {"side_channel_port": 5600, "side_channel_ports": "rank"})
    assert [cfg.rank_port(r, dp, 2) for dp in range(2) for r in range(2)] == [5600, 5601, 5602, 5603]
    assert cfg.instance_port(1, 2) == 5602


def test_a_bad_layout_or_no_room_left_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="side_channel_ports.*instance, rank"):
        parse_config("e", "kv_producer", {"side_channel_ports": "per_rank"})
    cfg = parse_config("e", "kv_producer", {"side_channel_port": 65535, "side_channel_ports": "rank"})
    cfg.check_ports(0, 1)
    with pytest.raises(ConfigError, match="data-parallel index 0 at tensor_parallel_size 2"):
        cfg.check_ports(0, 2)
    assert "leaves no room" in host_problems("nixl", cfg, ranks=2)[0]  # check-config --here says it too


def test_check_config_here_checks_each_data_parallel_engines_port() -> None:
    port = free_port()
    taken = sidechannel.SideChannelServer("127.0.0.1", port + 1, "h", lambda body: body)
    try:
        cfg = parse_config("e", "kv_producer", {"side_channel_port": port})
        assert host_problems("nixl", cfg, ranks=2, engines=1) == []  # rank 1 takes a port the system picks
        problems = host_problems("nixl", cfg, ranks=1, engines=2)
        assert len(problems) == 1 and f"127.0.0.1:{port + 1}" in problems[0]
    finally:
        taken.close()


def test_a_server_on_port_0_listens_where_the_system_picked() -> None:
    server = sidechannel.SideChannelServer("127.0.0.1", 0, "h", lambda body: wire.StatsReply(engine_id="x"))
    try:
        assert server.port > 0 and server.address.endswith(f":{server.port}")
        assert sidechannel.query_stats("127.0.0.1", server.port).engine_id == "x"
    finally:
        server.close()


@pytest.mark.parametrize(
    "text", ["", "host", "host:", ":5600", "host:0", "host:70000", "host:56a", "a b:1", "x" * 400 + ":1", 5600, None]
)
def test_an_address_a_peer_sent_is_checked(text: object) -> None:
    with pytest.raises(KVConnectorError, match="not a side-channel address"):
        sidechannel.parse_address(text)


def test_addresses_round_trip_v4_and_v6() -> None:
    for host in ("10.0.0.1", "::1", "p.example"):
        assert sidechannel.parse_address(sidechannel.address(host, 5601)) == (host, 5601)
