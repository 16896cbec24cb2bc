"""The doctor's report for a terminal: facts, probes, peers, the recommendation (paste-able), warnings."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kv_connectors.modelgroups import ModelGroups


def _words(items: Sequence[str] | dict[str, str]) -> str:
    if isinstance(items, dict):
        return " ".join(f"{k}={v}" for k, v in items.items()) or "none"
    return ", ".join(items) or "none"


def render(report: dict[str, Any]) -> str:
    """The report for a terminal: facts, probes, the recommendation (paste-able), warnings."""
    lines = ["versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v)]
    d = report["devices"]
    lines.append(
        f"devices: GPUs {_words(d['gpus'])}; RDMA {_words(d['rdma_devices'])}; "
        f"GPUDirect RDMA {'yes' if d['gpudirect_rdma'] else 'no'}; NICs {_words(d['nics'])}"
    )
    u = report["ucx"]
    lines.append(f"UCX: within a host {u['within_host']}; across hosts {u['across_hosts']}; env {_words(u['env'])}")
    sel = u.get("selected")
    if sel:
        lines.append(
            f"UCX asked (UCX_PROTO_INFO, two processes here): FAILED: {sel['error']}"
            if "error" in sel
            else "UCX asked (UCX_PROTO_INFO, two processes here): "
            + "; ".join(f"{op} {','.join(sel[op]) or 'none'}" for op in ("read", "write", "messages"))
        )
    lines.append(f"transparent huge pages: {report['thp']}")
    for path, r in report["probe"].items():
        if "error" in r:
            lines.append(f"probe {path}: FAILED: {r['error']}")
        else:
            rounds = f"median of {len(r['read_rounds'])} rounds, " if len(r.get("read_rounds", [])) > 1 else ""
            lines.append(
                f"probe {path}: READ {r['read_gbps']} GB/s, WRITE {r['write_gbps']} GB/s ({rounds}16 KiB blocks, scattered)"
            )
    for p in report.get("peers", []):
        if "error" in p:
            lines.append(f"peer {p['peer']}: FAILED: {p['error']}")
        else:
            lines.append(f"peer {p['peer']} ({p['address']}): via {p['interface']}, UCX will use {p['transport']}")
    rec = report["recommendation"]
    if rec.get("transport"):
        lines.append(f"recommendation: transport {rec['transport']} ({rec['transport_why']})")
        lines.append(f"  mode {rec['mode']} ({rec['mode_why']}); staging {rec['staging']}")
        configs = rec["kv_transfer_config"]
        env = "".join(f"{k}={v} " for k, v in rec["env"].items())
        for side, label in (("prefill", "P"), ("decode", "D")):
            lines.append(
                f"  {label}: {env}vllm serve MODEL --kv-transfer-config '{json.dumps(configs[side], separators=(',', ':'))}'"
            )
        lines.append('  (P and D on one host; across hosts add "side_channel_host" on each: the address its peers reach it at)')
    lines += [f"WARNING: {w}" for w in rec["warnings"]]
    if "config_problems" in report:
        lines += [f"CONFIG PROBLEM: {p}" for p in report["config_problems"]] or ["config: OK here"]
    if "model" in report:
        lines += _model_lines(report["model"])
    if "elapsed_s" in report:
        lines.append(f"(doctor took {report['elapsed_s']} s)")
    return "\n".join(lines)


def _model_lines(model: dict[str, Any]) -> list[str]:
    """`--model`: its verdict, then a line per kind of cached layer, as check-config --model prints them."""
    if "error" in model:
        return [f"MODEL PROBLEM: {model['error']}"]
    groups = ModelGroups.from_dict(model)
    return [("model: " if groups.served else "MODEL PROBLEM: model: ") + groups.describe()]
