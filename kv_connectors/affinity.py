"""The engine thread's CPU affinity (`engine_cpus`): where vLLM's engine thread, and every thread it
starts afterwards, may run.

Why it exists: vLLM's built-in NixlConnector, on CPU platforms, pins the thread that creates it (the
engine thread) to the last core of each NUMA node ("reserve different cores for start_load_kv()"),
and the threads vLLM starts after it (the engine core's output and input threads) inherit that. With
the executor in the engine-core process, the engine thread and the output thread then share one core
and hand the GIL to each other without waking another core; unpinned, they run on two cores and the
engine thread waits for the GIL at ~1,000 handoffs a second (measured here, perf sched_switch: 985
GIL waits/s against 1), decoding 3-4% slower. `engine_cpus: "builtin"` does what the built-in does;
a CPU list pins explicitly; "" (the default) leaves the threads where vLLM and the OS put them.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable, Iterable

from kv_connectors.errors import ConfigError

logger = logging.getLogger(__name__)

BUILTIN = "builtin"  # the built-in NixlConnector's choice on CPU: the last core of each NUMA node


def parse_cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("0-3,8,10-11") as a set of CPU ids; ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def check_engine_cpus(key: str, value: object) -> str:
    """The config checker: "", "builtin" or a CPU list."""
    if not isinstance(value, str):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a string, got {value!r}")
    if value in ("", BUILTIN):
        return value
    try:
        parse_cpu_list(value)
    except ValueError:
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}] must be '' (leave the engine's threads alone), "
            f"{BUILTIN!r} (as vLLM's built-in NixlConnector: the last core of each NUMA node) or a CPU "
            f"list such as '0-3,8'; got {value!r}"
        ) from None
    return value


def numa_nodes(sysfs: str = "/sys/devices/system/node") -> list[frozenset[int]]:
    """Each NUMA node's CPUs (empty when the host does not say)."""
    nodes = []
    for path in sorted(glob.glob(os.path.join(sysfs, "node[0-9]*", "cpulist"))):
        with open(path) as f:
            text = f.read().strip()
        if text:
            nodes.append(parse_cpu_list(text))
    return nodes


def builtin_cpus(allowed: Iterable[int], nodes: list[frozenset[int]]) -> frozenset[int]:
    """The built-in's cores: the last core of each NUMA node, among those this process may use."""
    allowed = frozenset(allowed)
    picked = {max(node & allowed) for node in nodes if node & allowed}
    return frozenset(picked) if picked else frozenset({max(allowed)})


def resolve(setting: str, device_type: str, allowed: Iterable[int], nodes: list[frozenset[int]]) -> frozenset[int] | None:
    """The CPUs to pin the engine thread to, or None to leave it. "builtin" applies on CPU platforms
    only, as the built-in's does; an explicit list anywhere, and it must name CPUs this process may use."""
    if not setting:
        return None
    if setting == BUILTIN:
        return builtin_cpus(allowed, nodes) if device_type == "cpu" else None
    cpus = parse_cpu_list(setting)
    usable = cpus & frozenset(allowed)
    if not usable:
        raise ConfigError(
            f"kv_connector_extra_config['engine_cpus'] = {setting!r} names no CPU this process may run on "
            f"(allowed: {sorted(allowed)})"
        )
    return usable


def apply(
    setting: str,
    device_type: str,
    *,
    getaffinity: Callable[[int], set[int]] = os.sched_getaffinity,
    setaffinity: Callable[[int, Iterable[int]], None] = os.sched_setaffinity,
    nodes: list[frozenset[int]] | None = None,
) -> frozenset[int] | None:
    """Pin the calling thread (vLLM's engine thread, at connector creation) per the setting; the CPUs
    it now runs on, or None when left alone."""
    cpus = resolve(setting, device_type, getaffinity(0), numa_nodes() if nodes is None else nodes)
    if cpus is None:
        return None
    setaffinity(0, cpus)
    logger.info("engine_cpus=%r: the engine thread (and the threads it starts) run on CPUs %s", setting, sorted(cpus))
    return cpus
