"""`doctor --peer`: the interface that reaches a peer, and what UCX will use there (deduced, or asked of a `doctor --serve`)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from typing import Any

from kv_connectors.doctor.facts import rdma_allowed, rdma_of
from kv_connectors.doctor.facts import within_host as within_host_deduced
from kv_connectors.doctor.peerprobe import parse_peer
from kv_connectors.doctor.ucxinfo import ask_peer, network_only


def route(address: str) -> dict[str, Any]:
    """How the kernel reaches `address` (`ip -j route get`): {"type", "dev", ...}, or {"error"}."""
    if shutil.which("ip") is None:
        return {"error": "`ip` (iproute2) is not installed: cannot tell the interface"}
    try:
        proc = subprocess.run(["ip", "-j", "route", "get", address], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"ip route get {address}: {e}"}
    if proc.returncode != 0:
        return {"error": f"no route to {address}: {proc.stderr.strip() or 'ip route get failed'}"}
    try:
        entries = json.loads(proc.stdout)
    except ValueError:
        return {"error": f"ip route get {address}: unreadable answer"}
    return dict(entries[0]) if entries else {"error": f"no route to {address}"}


def peer_path(
    host: str, dev: dict[str, Any], env: dict[str, str], within_host: str | None = None, port: int | None = None
) -> dict[str, Any]:
    """What UCX will use between this host and a peer at `host`: the interface the kernel routes
    through, the RDMA device behind it (if any), and whether UCX_TLS / UCX_NET_DEVICES let UCX
    use them, deduced from the routing table and sysfs (for a peer on this host, within_host: the
    report's answer); warnings for traps. With the port of a `doctor --serve` there, UCX is asked
    instead (ask_peer: the lanes it chose and the GB/s it moved), and a failure to move bytes is an error."""
    out = deduced_path(host, dev, env, within_host)
    if port is None or "error" in out:
        return out
    asked = ask_peer(out["address"], port)
    if "error" in asked:
        return {**out, "error": f"UCX moved no KV to the doctor --serve at {host}:{port}: {asked['error']}"}
    out["asked"] = asked
    out["transport"] = (
        f"READ {','.join(asked['read']) or 'none'}, WRITE {','.join(asked['write']) or 'none'} "
        f"(asked of UCX through the doctor --serve at {host}:{port})"
    )
    out["warnings"] = [w for w in out["warnings"] if " go over TCP " not in w]  # the deduction's, now answered
    tcp = [lane for lane in network_only(asked) if lane.startswith("tcp/")]
    if tcp:
        out["warnings"].insert(
            0,
            f"transfers to {host} go over TCP (UCX chose {','.join(tcp)}; READ {asked['read_gbps']} GB/s, "
            f"WRITE {asked['write_gbps']} GB/s): expect TCP throughput, not RDMA's",
        )
    return out


def deduced_path(host: str, dev: dict[str, Any], env: dict[str, str], within_host: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"peer": host, "warnings": []}
    try:
        address = str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except (OSError, UnicodeError) as e:
        return {**out, "error": f"cannot resolve {host}: {e}"}
    out["address"] = address
    r = route(address)
    if "error" in r:
        return {**out, "error": r["error"]}
    out["interface"] = r.get("dev")
    tls, net_devices = env.get("UCX_TLS", ""), env.get("UCX_NET_DEVICES", "")
    if r.get("type") == "local":
        out["transport"] = within_host or within_host_deduced(dev)
        return out
    rdma = rdma_of(str(out["interface"]))
    out["rdma_devices"] = rdma
    if rdma and rdma_allowed(tls):
        out["transport"] = f"rc/ud over {','.join(rdma)} (behind {out['interface']})"
    else:
        out["transport"] = f"tcp over {out['interface']}"
        why = f"UCX_TLS={tls} leaves {','.join(rdma)} out" if rdma else f"{out['interface']} has no RDMA device"
        out["warnings"].append(f"transfers to {host} go over TCP ({why}): expect the interface's TCP throughput, not RDMA's")
    if net_devices and net_devices != "all":
        names = {d.split(":")[0] for d in net_devices.split(",")}
        if not names & {out["interface"], *rdma}:
            out["warnings"].append(
                f"UCX_NET_DEVICES={net_devices} does not include {out['interface']}, the interface that reaches "
                f"{host}: UCX may fail to connect or wait until a timeout; add it"
            )
    return out


def peer_report(spec: str, dev: dict[str, Any], u: dict[str, Any]) -> dict[str, Any]:
    """One --peer: HOST or HOST:PORT (a `doctor --serve` there) against the report's devices and UCX facts."""
    try:
        host, port = parse_peer(spec)
    except ValueError as e:
        return {"peer": spec, "warnings": [], "error": str(e)}
    return peer_path(host, dev, u["env"], u["within_host"], port)
