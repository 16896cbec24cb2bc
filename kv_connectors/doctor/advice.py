"""The doctor's recommendation: transport, mode and staging from what was measured, and P's and D's --kv-transfer-config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kv_connectors.config import ConnectorConfig
from kv_connectors.doctor.ucxinfo import network_only

MARGIN = 1.5  # one choice over another only when every round of it beats every round of the other by this
CONNECTORS = {
    "nixl": {"kv_connector": "NixlConnector", "kv_connector_module_path": "kv_connectors.nixl"},
    "mooncake": {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connectors.mooncake"},
}
DEFAULT_MODE = {"nixl": "pull", "mooncake": "push"}


def _rounds(result: dict[str, Any], op: str) -> list[float]:
    values = result.get(f"{op}_rounds") or [result[f"{op}_gbps"]]
    return [float(v) for v in values]


def beats(a: Sequence[float], b: Sequence[float], margin: float = MARGIN) -> bool:
    """Whether a is faster than b beyond the noise: every round of a above every round of b times margin."""
    return bool(a) and bool(b) and min(a) > margin * max(b)


def transfer_configs(transport: str, mode: str, staging_on: bool) -> dict[str, dict[str, Any]]:
    """The --kv-transfer-config of P and of D for this recommendation, for both on one host (D's port
    leaves room for P's tensor-parallel ranks; across hosts each also needs side_channel_host)."""
    port = ConnectorConfig.side_channel_port
    staging = {"staging": "on"} if staging_on else {}
    mode_key = {"mode": mode} if mode in ("pull", "push") and mode != DEFAULT_MODE[transport] else {}
    return {
        "prefill": {
            **CONNECTORS[transport],
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"side_channel_port": port, **staging},
        },
        "decode": {
            **CONNECTORS[transport],
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"side_channel_port": port + 10, **mode_key, **staging},
        },
    }


def choose(direct: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """(transport, why): the fastest reader, NIXL where the other is not faster beyond the margin."""
    best = max(direct, key=lambda k: direct[k]["read_gbps"])
    others = [k for k in direct if k != best]
    if not others:
        return best, f"the only transport that works here (READ {direct[best]['read_gbps']} GB/s)"
    other = others[0]
    if beats(_rounds(direct[best], "read"), _rounds(direct[other], "read")):
        return best, f"READ {direct[best]['read_gbps']} GB/s against {other}'s {direct[other]['read_gbps']}"
    return "nixl", f"either ({best} not {MARGIN:g}x faster here in every round): nixl, the default"


def _mode(result: dict[str, Any], transport: str) -> tuple[str, str]:
    """(mode, why): push where WRITE beats READ beyond the margin, pull where READ beats WRITE, else either."""
    read, write = _rounds(result, "read"), _rounds(result, "write")
    figures = f"READ {result['read_gbps']} GB/s, WRITE {result['write_gbps']} GB/s"
    if beats(write, read):
        return "push", f"WRITE beats READ by over {MARGIN:g}x in every round ({figures})"
    if beats(read, write):
        return "pull", f"READ beats WRITE by over {MARGIN:g}x in every round ({figures})"
    default = DEFAULT_MODE[transport]
    return "either", f"within {MARGIN:g}x of each other ({figures}): {default}, {transport}'s default"


def recommend(report: dict[str, Any]) -> dict[str, Any]:
    """Transport, mode, staging, environment and the --kv-transfer-config of P and D, with warnings."""
    dev, paths = report["devices"], report["probe"]
    warnings: list[str] = list(report["known_problems"])
    env: dict[str, str] = {}
    direct = {k: v for k, v in paths.items() if not k.endswith("+staged") and "error" not in v}
    if not paths:
        return {"transport": None, "warnings": warnings}  # --no-probe: nothing measured, nothing to recommend
    if not direct:
        return {"transport": None, "warnings": [*warnings, "no transport works on this host: install kv-connectors[nixl]"]}
    best, transport_why = choose(direct)
    mode, mode_why = _mode(direct[best], best)
    staged = paths.get(f"{best}+staged", {})
    staging_on = bool(dev["gpus"] and dev["rdma_devices"] and not dev["gpudirect_rdma"])
    if staging_on:
        staging = "on across hosts (the NIC cannot reach GPU memory without GPUDirect RDMA: nvidia_peermem)"
    else:
        staging = "off (auto stages only where device memory cannot be registered)"
    if not dev["rdma_devices"]:
        warnings.append(
            "no RDMA device: transfers between hosts go over TCP (UCX tcp, Mooncake tcp); within a host "
            f"UCX uses {report['ucx']['within_host']}. Expect TCP throughput across hosts"
        )
    if len(dev["nics"]) > 1 and "UCX_NET_DEVICES" not in report["ucx"]["env"]:
        warnings.append(
            f"several network devices ({', '.join(dev['nics'])}) and no UCX_NET_DEVICES: UCX may pick a slow "
            "or unroutable one, or hang until a timeout; set it to the interface P and D share"
        )
        env["UCX_NET_DEVICES"] = dev["rdma_devices"][0] + ":1" if dev["rdma_devices"] else dev["nics"][0]
    slow = network_only(report["ucx"].get("selected", {}))
    if slow:
        warnings.append(
            f"UCX moves data between two processes of this host over the network ({', '.join(slow)}), not "
            "cma/shm: UCX_TLS leaves them out, or the container forbids cross-process memory access "
            "(cma needs ptrace rights: kernel.yama.ptrace_scope, CAP_SYS_PTRACE); a P and D on one host "
            "then move KV at TCP speed"
        )
    if report["thp"] == "never":
        warnings.append("transparent huge pages are off: registering large KV caches is slower")
    if "error" not in staged and staged and staged["read_gbps"] < 0.5 * direct[best]["read_gbps"]:
        warnings.append(
            f"staging here runs at {staged['read_gbps']} GB/s against {direct[best]['read_gbps']} direct: stage only where needed"
        )
    configs = transfer_configs(best, mode, staging_on)
    return {
        "transport": best,
        "transport_why": transport_why,
        "mode": mode,
        "mode_why": mode_why,
        "staging": staging,
        "env": env,
        "extra_config": configs["decode"]["kv_connector_extra_config"],
        "kv_transfer_config": configs,
        "warnings": warnings,
    }
