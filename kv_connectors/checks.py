"""The checks behind `kv-connectors check-config` and `doctor --config`: a --kv-transfer-config and this host.

`check_transfer_config` runs what start-up runs, in start-up's order: vLLM's own parse of the JSON
(`KVTransferConfig`, where vLLM is importable: a top-level typo or a `kv_load_failure_policy` vLLM does
not know stops vLLM before our connector exists), then the connector's (which class the names load,
the role, every `kv_connector_extra_config` key, parallelism, the transport's engine). It also names the
keys that do nothing for the chosen connector or role. `host_problems` is what this host must offer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kv_connectors import affinity
from kv_connectors.config import TRANSPORT_DEFAULTS, ConnectorConfig, Role, Staging, check_parallelism, parse_config
from kv_connectors.errors import ConfigError, KVConnectorError
from kv_connectors.transports import require_transport

# What each connector name loads (module path form and entry-point names).
_OURS: dict[tuple[str, str], str] = {
    ("NixlConnector", "kv_connectors.nixl"): "nixl",
    ("MooncakeConnector", "kv_connectors.mooncake"): "mooncake",
    ("NixlConnector", "kv_connectors.vllm.connector"): "nixl",
    ("MooncakeConnector", "kv_connectors.vllm.connector"): "mooncake",
    ("KvcNixlConnector", ""): "nixl",
    ("KvcMooncakeConnector", ""): "mooncake",
}
_RDMA_SYSFS = Path("/sys/class/infiniband")

# Keys that only one transport reads, and keys that only one side reads (the rest: both sides).
KEY_TRANSPORT: dict[str, str] = {
    "nixl_backend": "nixl",
    "progress_delay_us": "nixl",
    "nixl_num_threads": "nixl",
    "backends": "nixl",
    "num_threads": "nixl",
    "mooncake_protocol": "mooncake",
    "mooncake_device_name": "mooncake",
}
KEY_SIDE: dict[str, Role] = {
    "lease_s": Role.PRODUCER,
    "kv_lease_duration": Role.PRODUCER,
    "layerwise": Role.PRODUCER,
    "lease_renew_after_s": Role.CONSUMER,
    "handshake_timeout_s": Role.CONSUMER,
    "settle_timeout_s": Role.CONSUMER,
    "mode": Role.CONSUMER,
}


@dataclasses.dataclass(frozen=True)
class Checked:
    """A configuration that would start: its transport, the parsed config, what vLLM said, notes."""

    kind: str
    config: ConnectorConfig
    vllm: str | None  # the vLLM version whose KVTransferConfig accepted the JSON; None: not importable here
    warnings: tuple[str, ...] = ()


def transport_of(transfer_config: Mapping[str, Any]) -> str:
    """The transport kind the JSON's connector name (and module path) loads, or a ConfigError saying
    that it loads something else (vLLM's built-in connector, say)."""
    name = transfer_config.get("kv_connector")
    module = transfer_config.get("kv_connector_module_path") or ""
    if not isinstance(name, str) or not isinstance(module, str):
        raise ConfigError("kv_connector (and kv_connector_module_path, if given) must be strings")
    kind = _OURS.get((name, module))
    if kind is not None:
        return kind
    known = ", ".join(f"{n} + {m}" if m else n for n, m in _OURS)
    if not module and name in ("NixlConnector", "MooncakeConnector"):
        raise ConfigError(
            f"kv_connector {name!r} without kv_connector_module_path loads vLLM's built-in {name}, not ours: "
            f'add "kv_connector_module_path": "kv_connectors.{name[: -len("Connector")].lower()}"'
        )
    raise ConfigError(f"kv_connector {name!r} with module path {module!r} is not one of ours ({known})")


def vllm_validate(transfer_config: Mapping[str, Any]) -> str | None:
    """Parse the JSON object with vLLM's own KVTransferConfig, as `vllm serve --kv-transfer-config` does:
    vLLM's version when it accepts it, None when vLLM cannot be imported here, else a ConfigError with
    vLLM's reasons (one a field, the closest field named for an unknown one)."""
    with engine_output(verbose=False):  # importing vLLM logs to stdout
        try:
            import vllm
            from vllm.config import KVTransferConfig
        except Exception:  # not installed, or a broken install: either way vLLM cannot check it here
            return None
        fields = [f.name for f in dataclasses.fields(KVTransferConfig)]
        try:
            KVTransferConfig(**transfer_config)
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            raise ConfigError(f"vLLM {vllm.__version__} refuses this --kv-transfer-config: {_reasons(e, fields)}") from None
    return str(vllm.__version__)


NO_VLLM = "vLLM is not importable here: the top-level keys were not checked against vLLM's KVTransferConfig"


def _reasons(error: Exception, fields: list[str]) -> str:
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return str(error)
    out = []
    for item in errors():
        where = ".".join(str(part) for part in item.get("loc", ())) or "the config"
        reason = f"{where}: {item.get('msg', 'invalid')}"
        if item.get("type") == "unexpected_keyword_argument":
            close = difflib.get_close_matches(where, fields, n=1)
            reason += f" (did you mean {close[0]!r}?)" if close else f" (vLLM's keys: {', '.join(fields)})"
        elif "input" in item and not isinstance(item["input"], dict):
            reason += f" (got {item['input']!r})"
        out.append(reason)
    return "; ".join(out)


def unused_keys(kind: str, role: Role, extra: Mapping[str, Any]) -> list[str]:
    """Warnings for keys of `extra` that do nothing for this transport or this side."""
    out = []
    for key in sorted(extra):
        transport = KEY_TRANSPORT.get(key)
        side = KEY_SIDE.get(key)
        if transport is not None and transport != kind:
            out.append(f"{key!r} is a {transport} key: it does nothing for the {kind} connector")
        elif side is not None and role is not Role.BOTH and side is not role:
            reader = "prefill (kv_producer)" if side is Role.PRODUCER else "decode (kv_consumer)"
            out.append(f"{key!r} is read on the {reader} side only: it does nothing on a {role.value}")
    return out


def check_transfer_config(
    transfer_config: Any, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, with_vllm: bool = True
) -> Checked:
    """What start-up would say of a --kv-transfer-config (parsed JSON): a Checked, or its ConfigError."""
    if not isinstance(transfer_config, dict):
        raise ConfigError(f"the kv-transfer-config must be a JSON object; got {type(transfer_config).__name__}")
    version = vllm_validate(transfer_config) if with_vllm else None
    notes = [NO_VLLM] if with_vllm and version is None else []
    kind = transport_of(transfer_config)
    check_parallelism(tensor_parallel_size, pipeline_parallel_size, f"{kind} connector")
    extra = transfer_config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config must be a JSON object")
    engine_id = transfer_config.get("engine_id") or "check-config"  # vLLM makes one up when absent
    cfg = parse_config(str(engine_id), transfer_config.get("kv_role"), extra, TRANSPORT_DEFAULTS[kind])
    require_transport(kind)
    return Checked(kind, cfg, version, tuple(notes + unused_keys(kind, cfg.role, extra) + staging_notes(kind, cfg, extra)))


_FRAGMENT_KEYS = ("staging_fragment_runs", "staging_fragment_kib")


def staging_notes(kind: str, cfg: ConnectorConfig, extra: Mapping[str, Any]) -> list[str]:
    """Warnings for a staging choice that does nothing or is measured to be slower."""
    if cfg.staging is not Staging.FRAGMENTED:
        return [f"{key!r} does nothing unless staging is 'fragmented'" for key in _FRAGMENT_KEYS if key in extra]
    if kind == "nixl":
        return [
            "staging 'fragmented' is measured for Mooncake over TCP; NIXL on one host (cma) moved a shuffled "
            "table 2.5x faster directly: compare with staging 'off' before keeping it"
        ]
    return []


def host_problems(kind: str, cfg: ConnectorConfig, ranks: int = 1, engines: int = 1) -> list[str]:
    """What this host lacks for the configuration: side-channel ports that cannot be bound now (of
    `ranks` TP ranks in each of `engines` data-parallel engines; ports the system picks are not
    checked), RDMA devices for Mooncake's rdma protocol, an engine_cpus list naming no CPU this
    process may use."""
    if ranks < 1 or engines < 1:
        return [f"tensor- and data-parallel sizes must be >= 1, got {ranks} and {engines}"]
    try:
        cfg.check_ports(engines - 1, ranks)  # the last engine's ports are the highest
    except ConfigError as e:
        return [str(e)]
    problems = []
    for port in sorted({cfg.rank_port(rank, dp, ranks) for dp in range(engines) for rank in range(ranks)} - {0}):
        with socket.socket(socket.AF_INET6 if ":" in cfg.bind_host else socket.AF_INET) as s:
            try:
                s.bind((cfg.bind_host, port))
            except OSError as e:
                problems.append(
                    f"side channel {cfg.bind_host}:{port} cannot be bound here ({e.strerror}): give this instance "
                    "its own side_channel_port (or VLLM_NIXL_SIDE_CHANNEL_PORT), or a local side_channel_bind_host"
                )
    if kind == "mooncake" and cfg.mooncake_protocol == "rdma":
        devices = sorted(p.name for p in _RDMA_SYSFS.iterdir()) if _RDMA_SYSFS.is_dir() else []
        if not devices:
            problems.append("mooncake_protocol 'rdma' needs an RDMA device and this host has none: use 'tcp'")
        elif cfg.mooncake_device_name and not set(cfg.mooncake_device_name.split(",")) <= set(devices):
            problems.append(f"mooncake_device_name {cfg.mooncake_device_name!r} is not among this host's {devices}")
    try:
        affinity.resolve(cfg.engine_cpus, "cpu", os.sched_getaffinity(0), affinity.numa_nodes())
    except ConfigError as e:
        problems.append(str(e))
    return problems


def config_problems(config_json: str) -> list[str]:
    """What stops `config_json` (a --kv-transfer-config) on this host, as `check-config --here` says it,
    plus a spinning NIXL progress thread; [] if nothing."""
    try:
        checked = check_transfer_config(json.loads(config_json))
    except (ValueError, KVConnectorError) as e:
        return [str(e)]
    problems = host_problems(checked.kind, checked.config)
    if checked.config.progress_delay_us == 0 and checked.kind == "nixl":
        problems.append("progress_delay_us 0 makes NIXL's progress thread spin a whole core; keep the default")
    return problems


@contextlib.contextmanager
def engine_output(verbose: bool) -> Iterator[None]:
    """While inside, what engines print (NIXL's logger and vLLM's write to stdout, UCX and Mooncake's
    glog to stderr; child processes inherit both) is dropped, or with `verbose` sent to stderr: stdout
    stays for the command's own answer. Both the file descriptors and Python's sys.stdout/stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    py_out, py_err = sys.stdout, sys.stderr
    try:
        with open(os.devnull, "wb") as sink, open(os.devnull, "w") as text_sink:
            os.dup2(saved[2] if verbose else sink.fileno(), 1)
            if not verbose:
                os.dup2(sink.fileno(), 2)
            sys.stdout = py_err if verbose else text_sink
            sys.stderr = py_err if verbose else text_sink
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                sys.stdout, sys.stderr = py_out, py_err
                for fd, copy in saved.items():
                    os.dup2(copy, fd)
    finally:
        for copy in saved.values():
            os.close(copy)
