"""`kv-connectors doctor` itself: the facts, the probes, the peers and the recommendation gathered into one report; `--serve`."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from kv_connectors import checks, modelgroups
from kv_connectors.doctor.advice import choose, recommend
from kv_connectors.doctor.facts import devices, known_problems, transparent_huge_pages, ucx, versions
from kv_connectors.doctor.local_probe import probe_local
from kv_connectors.doctor.peerprobe import DEFAULT_PORT, parse_peer
from kv_connectors.doctor.peerprobe import serve as serve_probers
from kv_connectors.doctor.peers import peer_report
from kv_connectors.doctor.ucxinfo import proto_info_log, selected_in, ucx_selection
from kv_connectors.errors import ConfigError, KVConnectorError
from kv_connectors.transports import require_transport


def probe_all() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every installed transport between two processes here, then the fastest one through CPU staging
    (what the staging warning compares), and what UCX chose for NIXL's (asked of UCX: its protocol
    tables, logged while the probes ran)."""
    results: dict[str, dict[str, Any]] = {}
    paths: list[tuple[str, bool]] = []
    for kind in ("nixl", "mooncake"):
        try:
            require_transport(kind)
        except KVConnectorError as e:
            results[kind] = {"error": str(e)}
            continue
        paths.append((kind, False))

    def staged_fastest(done: dict[str, dict[str, Any]]) -> list[tuple[str, bool]]:
        direct = {k: v for k, v in done.items() if "error" not in v}
        return [(choose(direct)[0], True)] if direct else []

    selected: dict[str, Any] = {"error": "NIXL is not installed: UCX was not asked"}
    with proto_info_log() as folder:
        results.update(probe_local(paths, then=staged_fastest) if paths else {})
        if ("nixl", False) in paths:
            selected = selected_in(folder)
    if ("nixl", False) in paths and "error" in selected:  # UCX was loaded before here: ask a fresh child
        selected = ucx_selection()
    return {k: results[k] for k in sorted(results, key=lambda k: (k.split("+")[0] != "nixl", k))}, selected


def model_report(path: str) -> dict[str, Any]:
    """`--model`: the model's cached layers by kind and start-up's verdict, or why its config was unreadable."""
    try:
        return {"path": path, **modelgroups.model_groups(modelgroups.read_config(path)).as_dict()}
    except ConfigError as e:
        return {"path": path, "error": str(e)}


def diagnose(
    *, probe_paths: bool = True, config: str | None = None, peers: Sequence[str] = (), model: str | None = None
) -> dict[str, Any]:
    started = time.monotonic()
    v = versions()
    dev = devices()
    report: dict[str, Any] = {
        "versions": v,
        "known_problems": known_problems(v, dev["gpus"]),
        "devices": dev,
        "ucx": ucx(dev),
        "thp": transparent_huge_pages(),
        "probe": {},
    }
    if probe_paths:
        report["probe"], selected = probe_all()
        report["ucx"]["selected"] = selected
        if "error" not in selected:
            report["ucx"]["within_host"] = (
                f"READ {','.join(selected['read'])}, WRITE {','.join(selected['write'])} (asked of UCX: UCX_PROTO_INFO)"
            )
    report["recommendation"] = recommend(report)
    if peers:
        # within_host is UCX's own answer where it was asked, else the same deduction peer_path makes
        report["peers"] = [peer_report(spec, dev, report["ucx"]) for spec in peers]
        report["recommendation"]["warnings"] += [w for p in report["peers"] for w in p["warnings"]]
    if config is not None:
        report["config_problems"] = checks.config_problems(config)
    if model is not None:
        report["model"] = model_report(model)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


def run(
    *,
    probe_paths: bool = True,
    config: str | None = None,
    peers: Sequence[str] = (),
    model: str | None = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """diagnose() with the engines' own output dropped (or, verbose, on stderr): stdout is the report's."""
    with checks.engine_output(verbose):
        return diagnose(probe_paths=probe_paths, config=config, peers=peers, model=model)


def exit_status(report: dict[str, Any]) -> int:
    """2 when the given configuration cannot work here, a peer is unreachable or the given model would
    be refused at start-up (or its config cannot be read), else 0."""
    unreachable = any("error" in p for p in report.get("peers", []))
    model = report.get("model")
    refused = model is not None and ("error" in model or not model["served"])
    return 2 if report.get("config_problems") or unreachable or refused else 0


def serve(spec: str, seconds: float) -> int:
    """`doctor --serve ADDRESS[:PORT]`: answer other hosts' probes for `seconds`."""
    try:
        host, port = parse_peer(spec)
    except ValueError as e:
        print(f"error: --serve: {e}", file=sys.stderr)
        return 2
    serve_probers(host, port or DEFAULT_PORT, seconds)
    return 0
