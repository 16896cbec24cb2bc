"""Drop-in for vLLM's built-in NixlConnector: its side-channel env vars and extra-config keys."""

from __future__ import annotations

import logging

import pytest

from kv_connectors.config import BUILTIN_WITHOUT_EFFECT, parse_config
from kv_connectors.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)


def test_builtin_side_channel_env_vars_are_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two instances launched as the built-in's docs show (distinct env vars, no port in the config)
    get distinct ports, instead of both taking 5710."""
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5601")
    cfg = parse_config("p", "kv_producer", {})
    assert (cfg.side_channel_host, cfg.side_channel_port) == ("10.1.2.3", 5601)
    # As the built-in: one port per instance, the data-parallel index added; other TP ranks are
    # found through rank 0 (a port the system picks), so P 5600 and D 5601 never collide at TP 2.
    assert (cfg.instance_port(dp_index=0, tp_size=2), cfg.rank_port(1, 0, 2)) == (5601, 0)
    assert cfg.instance_port(dp_index=1, tp_size=2) == 5602
    # Our keys win over the environment.
    cfg = parse_config("p", "kv_producer", {"side_channel_port": 7000, "side_channel_host": "127.0.0.1"})
    assert (cfg.side_channel_host, cfg.side_channel_port) == ("127.0.0.1", 7000)


def test_without_the_env_vars_the_defaults_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config("p", "kv_producer", {})
    assert (cfg.side_channel_host, cfg.side_channel_port) == ("127.0.0.1", 5710)


@pytest.mark.parametrize("value", ["abc", "70000", "-1"])
def test_a_bad_builtin_port_env_var_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", value)
    with pytest.raises(ConfigError, match="VLLM_NIXL_SIDE_CHANNEL_PORT"):
        parse_config("p", "kv_producer", {})


def test_builtin_extra_config_keys_map_to_ours() -> None:
    cfg = parse_config("d", "kv_consumer", {"kv_lease_duration": 12, "num_threads": 4, "backends": ["UCX"]})
    assert (cfg.lease_s, cfg.nixl_num_threads, cfg.nixl_backend) == (12.0, 4, "UCX")
    with pytest.raises(ConfigError, match="exactly one NIXL backend"):
        parse_config("d", "kv_consumer", {"backends": ["UCX", "GDS"]})
    with pytest.raises(ConfigError, match="nixl_backend"):
        parse_config("d", "kv_consumer", {"backends": ["LIBFABRIC"]})
    with pytest.raises(ConfigError, match="different values"):
        parse_config("d", "kv_consumer", {"kv_lease_duration": 12, "lease_s": 20})
    with pytest.raises(ConfigError, match="lease_s"):
        parse_config("d", "kv_consumer", {"kv_lease_duration": -3})


def test_builtin_keys_without_effect_are_accepted_loudly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kv_connectors.config"):
        parse_config("d", "kv_consumer", dict.fromkeys(BUILTIN_WITHOUT_EFFECT, True))
    for key in BUILTIN_WITHOUT_EFFECT:
        assert any(key in r.getMessage() and "no effect" in r.getMessage() for r in caplog.records), key
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key"):
        parse_config("d", "kv_consumer", {"not_a_key_anywhere": 1})


def test_nixl_worker_threads_default_to_the_builtins_four(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's built-in gives its agent 4 UCX worker threads (num_threads, default 4); with NIXL's own
    # default (0) a post copies inline on the engine thread and a fragmented table moves at 0.6-0.7
    # of the coalesced speed (bench_transport, docs/benchmarks.md).
    import kv_connectors.transports as transports

    handed: dict[str, object] = {}

    def engine(*_: object) -> object:
        return lambda name, **kw: handed.update(kw)

    monkeypatch.setattr(transports, "_engine", engine)
    cfg = parse_config("d", "kv_consumer", {})
    assert cfg.nixl_num_threads == 4
    transports.create_transport("nixl", "d", cfg)
    assert handed["num_threads"] == 4
    transports.create_transport("nixl", "d", parse_config("d", "kv_consumer", {"nixl_num_threads": 0}))
    assert handed["num_threads"] is None  # 0: NIXL's default, the copy inside the post call
