"""`kv-connectors check-config`: offline, the same errors the connector raises at start-up."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from kv_connectors import cli
from kv_connectors.errors import ConfigError

NIXL = {"kv_connector": "NixlConnector", "kv_connector_module_path": "kv_connectors.nixl"}
MOONCAKE = {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connectors.mooncake"}

BAD_EXTRA = [
    {"lease_s": -1},
    {"no_such_key": 1},
    {"mode": "sideways"},
    {"side_channel_port": 70000},
    {"staging": "maybe"},
    {"staging_pool_kib": 1024, "staging_chunk_kib": 1024},
    {"side_channel_secret_env": "KVC_TEST_SECRET_NOT_SET"},
    {"backends": ["UCX", "GDS"]},
    {"nixl_backend": "LIBFABRIC"},
    {"mooncake_protocol": "ib"},
    {"idle_wait_ms": 500},
    {"engine_cpus": "all"},
]


def _run(*argv: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "kv_connectors", *argv, "--json"], capture_output=True, text=True, timeout=60)
    return proc.returncode, json.loads(proc.stdout)


def _start_up_error(extra: dict[str, Any], role: str = "kv_producer", tp: int = 1, pp: int = 1) -> str:
    """The ConfigError our connector raises when vLLM constructs it with this config."""
    from kv_connectors.nixl import NixlConnector
    from kv_connectors.vllm.compat import KVConnectorRole

    kvt = SimpleNamespace(engine_id="e", kv_role=role, kv_connector_extra_config=extra)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp), kv_transfer_config=kvt
    )
    with pytest.raises(ConfigError) as e:
        NixlConnector(vllm_config, KVConnectorRole.WORKER, None)
    return str(e.value)


@pytest.mark.parametrize("extra", BAD_EXTRA, ids=lambda e: ",".join(e))
def test_every_start_up_config_error_is_raised_offline_too(extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVC_TEST_SECRET_NOT_SET", raising=False)
    expected = _start_up_error(extra)
    with pytest.raises(ConfigError) as offline:
        cli.check_transfer_config({**NIXL, "kv_role": "kv_producer", "kv_connector_extra_config": extra})
    assert str(offline.value) == expected


def test_role_and_parallelism_errors_match_start_up() -> None:
    with pytest.raises(ConfigError) as offline:
        cli.check_transfer_config({**NIXL, "kv_role": "kv_prefiller"})
    assert str(offline.value) == _start_up_error({}, role="kv_prefiller")
    with pytest.raises(ConfigError) as offline:
        cli.check_transfer_config({**NIXL, "kv_role": "kv_consumer"}, pipeline_parallel_size=2)
    assert "pipeline_parallel_size 1 only" in str(offline.value)
    assert "pipeline_parallel_size 1 only" in _start_up_error({}, role="kv_consumer", pp=2)
    kind, _cfg = cli.check_transfer_config({**NIXL, "kv_role": "kv_consumer"}, tensor_parallel_size=2)
    assert kind == "nixl"  # TP is served rank to rank


def test_a_good_config_passes_with_a_summary() -> None:
    code, out = _run(
        "check-config", json.dumps({**MOONCAKE, "kv_role": "kv_consumer", "kv_connector_extra_config": {"lease_s": 5}})
    )
    assert code == 0 and out["ok"] and out["transport"] == "mooncake" and out["mode"] == "push" and out["lease_s"] == 5.0


def test_the_builtin_connector_name_alone_is_called_out() -> None:
    code, out = _run("check-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}))
    assert code == 2 and "vLLM's built-in NixlConnector, not ours" in out["error"] and "kv_connectors.nixl" in out["error"]
    code, out = _run("check-config", "{not json")
    assert code == 2 and "not valid JSON" in out["error"]


def test_here_finds_a_taken_port_and_missing_rdma() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = {**NIXL, "kv_role": "kv_producer", "kv_connector_extra_config": {"side_channel_port": port}}
        assert _run("check-config", json.dumps(config))[0] == 0  # the port is only checked --here
        code, out = _run("check-config", json.dumps(config), "--here")
        assert code == 2 and f"127.0.0.1:{port} cannot be bound here" in out["error"]
    rdma = {
        **MOONCAKE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake_protocol": "rdma", "side_channel_port": port},
    }
    code, out = _run("check-config", json.dumps(rdma), "--here")
    if cli.host_problems("mooncake", cli.check_transfer_config(rdma)[1]) == []:  # a host with RDMA devices
        assert code == 0
    else:
        assert code == 2 and "needs an RDMA device" in out["error"]
