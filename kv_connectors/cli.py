"""`kv-connectors` (also `python -m kv_connectors`): the command line of the operator commands.

Argument parsing and output only: `check-config` runs kv_connectors/checks.py, `doctor` runs
kv_connectors/doctor/ (and `doctor --serve`, kv_connectors/doctor/peerprobe.py). Exit status 0 when the
configuration would start (or the host offers what it needs), 2 when it would not, or for a bad flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kv_connectors import __version__, checks, modelgroups
from kv_connectors.errors import ConfigError

EPILOG = "Docs: docs/cli.md."


def _check_config(args: argparse.Namespace) -> int:
    try:
        transfer_config = json.loads(args.config)
    except json.JSONDecodeError as e:
        return _fail(args, f"the kv-transfer-config is not valid JSON: {e}")
    try:
        checked = checks.check_transfer_config(
            transfer_config, tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size
        )
    except ConfigError as e:
        return _fail(args, str(e))
    cfg = checked.config
    problems = checks.host_problems(checked.kind, cfg, args.tensor_parallel_size, args.data_parallel_size) if args.here else []
    if problems:
        return _fail(args, "; ".join(problems))
    groups = None
    if args.model is not None:
        try:
            groups = modelgroups.model_groups(modelgroups.read_config(args.model))
        except ConfigError as e:
            return _fail(args, str(e))
        if not groups.served:
            return _fail(args, f"model {args.model} ({groups.architecture}): {groups.refusal}", model=groups.as_dict())
    summary: dict[str, Any] = {
        "ok": True,
        "transport": checked.kind,
        "role": cfg.role.value,
        "mode": cfg.mode.value,
        "staging": cfg.staging.value,
        "side_channel": f"{cfg.side_channel_host}:{cfg.side_channel_port}",
        "bind": f"{cfg.bind_host}:{cfg.side_channel_port}",
        "lease_s": cfg.lease_s,
        "transfer_timeout_s": cfg.transfer_timeout_s,
        "authenticated": bool(cfg.side_channel_secret),
        "vllm": checked.vllm,
        "warnings": list(checked.warnings),
        "model": groups.as_dict() if groups is not None else None,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    shown = {k: v for k, v in summary.items() if k not in ("ok", "vllm", "warnings", "model")}
    if cfg.side_channel_host in ("127.0.0.1", "localhost", "::1"):
        shown["side_channel"] += " (this host only: set side_channel_host across hosts)"
    print("OK: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    if checked.vllm:
        print(f"accepted by vLLM {checked.vllm}'s KVTransferConfig")
    if groups is not None:
        print(f"model: {groups.describe()}")
    for warning in checked.warnings:
        print(f"warning: {warning}")
    return 0


def _fail(args: argparse.Namespace, message: str, **extra: Any) -> int:
    if args.json:
        print(json.dumps({"ok": False, "error": message, **extra}))
    else:
        print(f"error: {message}", file=sys.stderr)
    return 2


def _doctor(args: argparse.Namespace) -> int:
    from kv_connectors import doctor  # numpy and the engines: only for this command

    if args.serve is not None:
        return doctor.serve(args.serve, args.serve_s)
    report = doctor.run(
        probe_paths=not args.no_probe, config=args.config, peers=args.peer or (), model=args.model, verbose=args.verbose
    )
    print(json.dumps(report) if args.json else doctor.render(report))
    return doctor.exit_status(report)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="kv-connectors", description=(__doc__ or "").split("\n\n")[0], epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check-config",
        formatter_class=fmt,
        help="validate a --kv-transfer-config offline (exit 2 if it would not start)",
        description="Check a --kv-transfer-config as start-up would: vLLM's own KVTransferConfig (where vLLM is "
        "importable), then the connector's checks (connector name, role, every kv_connector_extra_config key, "
        "parallelism, the transport's engine, with --model the model's kinds of cached layers); keys that do "
        "nothing for that connector or role are named. "
        "Exit 0 when it would start, 2 when it would not.",
    )
    check.add_argument("config", help="the --kv-transfer-config JSON, as given to vLLM")
    check.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, help="as given to vLLM")
    check.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1, help="as given to vLLM")
    check.add_argument("-dp", "--data-parallel-size", type=int, default=1, help="as given to vLLM (--here: its ports)")
    check.add_argument("--here", action="store_true", help="also check this host: free side-channel port(s), RDMA devices")
    check.add_argument(
        "--model",
        metavar="PATH",
        help="also read this model's config.json (its directory or the file): its cached layers by kind (full, "
        "sliding window, chunked, Mamba, linear attention, MLA) and whether they are served (exit 2 if refused)",
    )
    check.add_argument("--json", action="store_true", help="one JSON object on stdout")
    check.set_defaults(run=_check_config)
    doc = sub.add_parser(
        "doctor",
        formatter_class=fmt,
        help="what this host offers (versions, devices, UCX, a short probe) and what to configure",
        description="Report this host's versions, devices and UCX, probe each installed transport between two "
        "processes, and recommend a --kv-transfer-config. Exit 2 when --config cannot work here or a --peer "
        "is unreachable.",
    )
    doc.add_argument("--config", help="also check this --kv-transfer-config here (exit 2 if it cannot work)")
    doc.add_argument(
        "--model",
        metavar="PATH",
        help="also show this model's cached layers by kind, from its config.json (exit 2 if start-up would refuse it)",
    )
    doc.add_argument("--no-probe", action="store_true", help="skip the two-process bandwidth probes")
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
    doc.add_argument("--json", action="store_true", help="one JSON object on stdout (engine output: stderr with -v)")
    doc.add_argument("-v", "--verbose", action="store_true", help="show the engines' own output (on stderr)")
    doc.set_defaults(run=_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
