"""`engine_cpus`: parsing, the built-in's choice of cores, and pinning the calling thread."""

from __future__ import annotations

import os
import threading

import pytest

from kv_connectors import affinity, checks
from kv_connectors.config import parse_config
from kv_connectors.errors import ConfigError

TWO_NODES = [frozenset(range(0, 4)), frozenset(range(4, 8))]


def test_cpu_lists_parse_as_linux_writes_them() -> None:
    assert affinity.parse_cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert affinity.parse_cpu_list("5") == {5}
    for bad in ("", "a", "3-1", "1-", "-1", "1,,2", "0x1"):
        with pytest.raises(ValueError):
            affinity.parse_cpu_list(bad)


@pytest.mark.parametrize("value", [3, "3-1", "all", "builtin,0", ["0"]])
def test_a_bad_engine_cpus_is_a_config_error_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="engine_cpus"):
        parse_config("e", "kv_consumer", {"engine_cpus": value})


def test_the_default_leaves_the_engine_alone() -> None:
    assert parse_config("e", "kv_consumer", None).engine_cpus == ""
    calls: list[object] = []
    assert affinity.apply("", "cpu", getaffinity=lambda _: {0, 1}, setaffinity=lambda *a: calls.append(a), nodes=[]) is None
    assert calls == []


def test_builtin_takes_the_last_allowed_core_of_each_numa_node_on_cpu_only() -> None:
    assert affinity.resolve("builtin", "cpu", range(8), TWO_NODES) == {3, 7}
    assert affinity.resolve("builtin", "cpu", {0, 1, 5}, TWO_NODES) == {1, 5}  # within this process's cpuset
    assert affinity.resolve("builtin", "cpu", {0, 1}, []) == {1}  # a host without NUMA sysfs
    assert affinity.resolve("builtin", "cuda", range(8), TWO_NODES) is None  # as the built-in: CPU platforms only


def test_an_explicit_list_applies_anywhere_within_the_allowed_cpus() -> None:
    assert affinity.resolve("2-5", "cuda", range(4), TWO_NODES) == {2, 3}
    with pytest.raises(ConfigError, match="engine_cpus.*no CPU"):
        affinity.resolve("8-9", "cpu", range(4), TWO_NODES)


def test_apply_pins_the_calling_thread_and_threads_it_starts_inherit_it() -> None:
    """Real sched_setaffinity on a thread of this process, as vLLM's engine thread gets it."""
    allowed = sorted(os.sched_getaffinity(0))
    seen: dict[str, object] = {}

    def engine_thread() -> None:
        seen["pinned"] = affinity.apply("builtin", "cpu", nodes=[frozenset(allowed)])
        seen["engine"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getaffinity(0)))
        child.start()
        child.join()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen["pinned"] == {allowed[-1]}
    assert seen["engine"] == {allowed[-1]} and seen["child"] == {allowed[-1]}
    assert os.sched_getaffinity(0) == set(allowed)  # the other threads are left alone


def test_check_config_names_an_engine_cpus_this_host_cannot_give() -> None:
    checked = checks.check_transfer_config(
        {
            "kv_connector": "NixlConnector",
            "kv_connector_module_path": "kv_connectors.nixl",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"engine_cpus": "4000-4001", "side_channel_port": 1},
        },
        with_vllm=False,
    )
    assert any("engine_cpus" in p and "no CPU" in p for p in checks.host_problems(checked.kind, checked.config))
