"""`kv-connectors check-config`: offline, vLLM's own parse first, then the same errors the connector
raises at start-up; keys that do nothing named; `--version`; one JSON object with `--json`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from kv_connectors import __version__, checks, cli
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


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    """The command in this process (vLLM imported once per test session): exit status and its JSON."""
    code = cli.main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


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
        checks.check_transfer_config({**NIXL, "kv_role": "kv_producer", "kv_connector_extra_config": extra}, with_vllm=False)
    assert str(offline.value) == expected


def test_role_and_parallelism_errors_match_start_up() -> None:
    with pytest.raises(ConfigError) as offline:
        checks.check_transfer_config({**NIXL, "kv_role": "kv_prefiller"}, with_vllm=False)
    assert str(offline.value) == _start_up_error({}, role="kv_prefiller")
    with pytest.raises(ConfigError) as offline:
        checks.check_transfer_config({**NIXL, "kv_role": "kv_consumer"}, pipeline_parallel_size=2, with_vllm=False)
    assert "pipeline_parallel_size 1 only" in str(offline.value)
    assert "pipeline_parallel_size 1 only" in _start_up_error({}, role="kv_consumer", pp=2)
    checked = checks.check_transfer_config({**NIXL, "kv_role": "kv_consumer"}, tensor_parallel_size=2, with_vllm=False)
    assert checked.kind == "nixl"  # TP is served rank to rank


def test_a_good_config_passes_with_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    config = {**MOONCAKE, "kv_role": "kv_consumer", "kv_connector_extra_config": {"lease_renew_after_s": 1}}
    code, out = _run(capsys, "check-config", json.dumps(config))
    assert code == 0 and out["ok"] and out["transport"] == "mooncake" and out["mode"] == "push" and out["warnings"] == []
    assert out["vllm"] == _vllm_version()


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


@pytest.mark.parametrize(
    ("top_level", "reason"),
    [
        ({"kv_conector_extra_config": {"lease_s": 5}}, "kv_conector_extra_config: Unexpected keyword argument"),
        ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy: Input should be 'recompute' or 'fail'"),
    ],
)
def test_what_vllm_itself_refuses_is_refused(capsys: pytest.CaptureFixture[str], top_level: dict[str, Any], reason: str) -> None:
    """Our connector never sees these: vLLM's own KVTransferConfig stops `vllm serve` first."""
    code, out = _run(capsys, "check-config", json.dumps({**NIXL, "kv_role": "kv_producer", **top_level}))
    assert code == 2 and f"vLLM {_vllm_version()} refuses" in out["error"] and reason in out["error"], out
    if "kv_conector_extra_config" in top_level:
        assert "did you mean 'kv_connector_extra_config'?" in out["error"]


def test_without_vllm_the_check_says_what_it_could_not_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm.config", None)  # `from vllm.config import ...` raises ImportError
    checked = checks.check_transfer_config({**NIXL, "kv_role": "kv_producer", "kv_load_failure_policy": "retry"})
    assert checked.vllm is None and checks.NO_VLLM in checked.warnings


def test_keys_that_do_nothing_for_the_connector_or_the_side_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    extra = {"nixl_backend": "UCX", "progress_delay_us": 500, "lease_renew_after_s": 1.0}
    code, out = _run(capsys, "check-config", json.dumps({**MOONCAKE, "kv_role": "kv_producer", "kv_connector_extra_config": extra}))
    assert code == 0
    assert out["warnings"] == [
        "'lease_renew_after_s' is read on the decode (kv_consumer) side only: it does nothing on a kv_producer",
        "'nixl_backend' is a nixl key: it does nothing for the mooncake connector",
        "'progress_delay_us' is a nixl key: it does nothing for the mooncake connector",
    ]
    both = {**NIXL, "kv_role": "kv_both", "kv_connector_extra_config": {"lease_s": 5, "mode": "push"}}
    assert checks.check_transfer_config(both, with_vllm=False).warnings == ()


def test_vllm_short_parallelism_flags_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    config = json.dumps({**NIXL, "kv_role": "kv_consumer"})
    assert _run(capsys, "check-config", config, "-tp", "2")[0] == 0
    code, out = _run(capsys, "check-config", config, "-pp", "2")
    assert code == 2 and "pipeline_parallel_size 1 only" in out["error"]


def test_text_output_says_who_checked_it(capsys: pytest.CaptureFixture[str]) -> None:
    config = {**MOONCAKE, "kv_role": "kv_producer", "kv_connector_extra_config": {"nixl_num_threads": 2}}
    assert cli.main(["check-config", json.dumps(config)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("OK: transport mooncake, role kv_producer") and "(this host only" in out[0]
    assert out[1] == f"accepted by vLLM {_vllm_version()}'s KVTransferConfig"
    assert out[2] == "warning: 'nixl_num_threads' is a nixl key: it does nothing for the mooncake connector"


def test_the_builtin_connector_name_alone_is_called_out(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, "check-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}))
    assert code == 2 and "vLLM's built-in NixlConnector, not ours" in out["error"] and "kv_connectors.nixl" in out["error"]
    code, out = _run(capsys, "check-config", "{not json")
    assert code == 2 and "not valid JSON" in out["error"]


def test_here_finds_a_taken_port_and_missing_rdma(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = {**NIXL, "kv_role": "kv_producer", "kv_connector_extra_config": {"side_channel_port": port}}
        assert _run(capsys, "check-config", json.dumps(config))[0] == 0  # the port is only checked --here
        code, out = _run(capsys, "check-config", json.dumps(config), "--here")
        assert code == 2 and f"127.0.0.1:{port} cannot be bound here" in out["error"]
    rdma = {
        **MOONCAKE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake_protocol": "rdma", "side_channel_port": port},
    }
    code, out = _run(capsys, "check-config", json.dumps(rdma), "--here")
    checked = checks.check_transfer_config(rdma, with_vllm=False)
    if checks.host_problems("mooncake", checked.config) == []:  # a host with RDMA devices
        assert code == 0
    else:
        assert code == 2 and "needs an RDMA device" in out["error"]


@pytest.mark.parametrize("argv", [["-m", "kv_connectors"], ["-m", "kv_connectors.proxy"]])
def test_both_commands_say_their_version(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, *argv, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == [proc.stdout.split()[0], __version__], proc


def test_check_config_warns_of_fragmented_staging_that_does_nothing_or_is_slower() -> None:
    def warnings(kind: dict[str, str], extra: dict[str, Any]) -> tuple[str, ...]:
        config = {**kind, "kv_role": "kv_consumer", "kv_connector_extra_config": extra}
        return checks.check_transfer_config(config, with_vllm=False).warnings

    assert warnings(MOONCAKE, {"staging": "fragmented", "staging_fragment_runs": 64}) == ()
    assert warnings(MOONCAKE, {"staging": "on", "staging_fragment_kib": 32}) == (
        "'staging_fragment_kib' does nothing unless staging is 'fragmented'",
    )
    (note,) = warnings(NIXL, {"staging": "fragmented"})
    assert "measured for Mooncake over TCP" in note
