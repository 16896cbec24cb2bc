"""`kv-connectors` (also `python -m kv_connectors`): operator commands that need no running server.

`doctor [--config JSON] [--peer HOST[:PORT] ...] [--json]`: versions, devices, UCX, THP, a short probe per
transport, the interface and UCX transport that reach each peer (asked of UCX through a `doctor --serve`
on the peer where a port is given), and a recommendation (kv_connectors/doctor.py); exit 2 when the given
configuration cannot work here or a peer is unreachable. `doctor --serve ADDRESS[:PORT]`: answer those
probes on this host (kv_connectors/peerprobe.py).

`check-config '<--kv-transfer-config JSON>'` validates a P or D configuration offline with the checks
the connector runs at start-up (the same functions, so the same errors): which connector the JSON
loads, the role, every `kv_connector_extra_config` key (the built-in connector's keys and env vars
included), tensor/pipeline parallelism, whether the transport's engine is installed, and, with
`--here`, what this host must offer (a free side-channel port, RDMA devices for Mooncake `rdma`).
Exit status 0 when the configuration would start, 2 when it would not.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kv_connectors import affinity
from kv_connectors.config import TRANSPORT_DEFAULTS, ConnectorConfig, check_parallelism, parse_config
from kv_connectors.errors import ConfigError
from kv_connectors.transports import require_transport

# What each connector name loads (module path form and entry-point names), and its defaults.
_OURS: dict[tuple[str, str], str] = {
    ("NixlConnector", "kv_connectors.nixl"): "nixl",
    ("MooncakeConnector", "kv_connectors.mooncake"): "mooncake",
    ("NixlConnector", "kv_connectors.vllm.connector"): "nixl",
    ("MooncakeConnector", "kv_connectors.vllm.connector"): "mooncake",
    ("KvcNixlConnector", ""): "nixl",
    ("KvcMooncakeConnector", ""): "mooncake",
}
_RDMA_SYSFS = Path("/sys/class/infiniband")


def transport_of(transfer_config: dict[str, Any]) -> str:
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


def check_transfer_config(
    transfer_config: Any, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1
) -> tuple[str, ConnectorConfig]:
    """(transport kind, parsed config) of a --kv-transfer-config, or the ConfigError start-up raises."""
    if not isinstance(transfer_config, dict):
        raise ConfigError(f"the kv-transfer-config must be a JSON object; got {type(transfer_config).__name__}")
    kind = transport_of(transfer_config)
    check_parallelism(tensor_parallel_size, pipeline_parallel_size, f"{kind} connector")
    extra = transfer_config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config must be a JSON object")
    engine_id = transfer_config.get("engine_id") or "check-config"  # vLLM makes one up when absent
    cfg = parse_config(str(engine_id), transfer_config.get("kv_role"), extra, TRANSPORT_DEFAULTS[kind])
    require_transport(kind)
    return kind, cfg


def host_problems(kind: str, cfg: ConnectorConfig, ranks: int = 1) -> list[str]:
    """What this host lacks for the configuration: side-channel ports that cannot be bound now, and
    RDMA devices for Mooncake's rdma protocol."""
    problems = []
    for rank in range(ranks):
        port = cfg.side_channel_port_for_rank(rank)
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


def _check_config(args: argparse.Namespace) -> int:
    try:
        transfer_config = json.loads(args.config)
    except json.JSONDecodeError as e:
        return _fail(args, f"the kv-transfer-config is not valid JSON: {e}")
    try:
        kind, cfg = check_transfer_config(
            transfer_config, tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size
        )
    except ConfigError as e:
        return _fail(args, str(e))
    problems = host_problems(kind, cfg, args.tensor_parallel_size) if args.here else []
    if problems:
        return _fail(args, "; ".join(problems))
    summary = {
        "ok": True,
        "transport": kind,
        "role": cfg.role.value,
        "mode": cfg.mode.value,
        "staging": cfg.staging.value,
        "side_channel": f"{cfg.side_channel_host}:{cfg.side_channel_port}",
        "bind": f"{cfg.bind_host}:{cfg.side_channel_port}",
        "lease_s": cfg.lease_s,
        "transfer_timeout_s": cfg.transfer_timeout_s,
        "authenticated": bool(cfg.side_channel_secret),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print("OK: " + ", ".join(f"{k} {v}" for k, v in summary.items() if k != "ok"))
    return 0


def _fail(args: argparse.Namespace, message: str) -> int:
    if args.json:
        print(json.dumps({"ok": False, "error": message}))
    else:
        print(f"error: {message}", file=sys.stderr)
    return 2


def _doctor(args: argparse.Namespace) -> int:
    from kv_connectors import doctor  # numpy and the engines: only for this command

    if args.serve is not None:
        from kv_connectors import peerprobe

        try:
            host, port = peerprobe.parse_peer(args.serve)
        except ValueError as e:
            print(f"error: --serve: {e}", file=sys.stderr)
            return 2
        peerprobe.serve(host, port or peerprobe.DEFAULT_PORT, args.serve_s)
        return 0

    report = doctor.diagnose(probe_paths=not args.no_probe, config=args.config, peers=args.peer or ())
    print(json.dumps(report) if args.json else doctor.render(report))
    unreachable = any("error" in p for p in report.get("peers", []))
    return 2 if report.get("config_problems") or unreachable else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-connectors", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-config", help="validate a --kv-transfer-config offline (exit 2 if it would not start)")
    check.add_argument("config", help="the --kv-transfer-config JSON, as given to vLLM")
    check.add_argument("--tensor-parallel-size", type=int, default=1, help="as given to vLLM")
    check.add_argument("--pipeline-parallel-size", type=int, default=1, help="as given to vLLM")
    check.add_argument("--here", action="store_true", help="also check this host: free side-channel port(s), RDMA devices")
    check.add_argument("--json", action="store_true", help="one JSON object on stdout")
    check.set_defaults(run=_check_config)
    doc = sub.add_parser("doctor", help="what this host offers (versions, devices, UCX, a short probe) and what to configure")
    doc.add_argument("--config", help="also check this --kv-transfer-config here (exit 2 if it cannot work)")
    doc.add_argument("--no-probe", action="store_true", help="skip the two-process bandwidth probe")
    doc.add_argument(
        "--peer",
        action="append",
        metavar="HOST[:PORT]",
        help="a P or D host this one exchanges KV with: the interface and UCX transport that reach it "
        "(repeatable; exit 2 if unreachable). With the PORT of a `doctor --serve` there, UCX is asked: "
        "a short READ and WRITE to it, the transport and device UCX chose, GB/s",
    )
    doc.add_argument(
        "--serve",
        metavar="ADDRESS[:PORT]",
        help="serve other hosts' `doctor --peer THIS_HOST:PORT` probes (a NIXL agent with a 32 MiB patterned "
        "buffer, on the address the peer reaches this host at; port 5799 unless given) for --serve-s seconds",
    )
    doc.add_argument("--serve-s", type=float, default=600.0, help="--serve: how long to serve (seconds)")
    doc.add_argument("--json", action="store_true", help="one JSON object on stdout")
    doc.set_defaults(run=_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
