"""What UCX itself says it chose: its UCX_PROTO_INFO tables, logged by NIXL probes here or in a child, parsed into lanes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kv_connectors.errors import KVConnectorError
from kv_connectors.transports import require_transport, ucx_on_loopback

# UCX_PROTO_INFO tables from NIXL READs and WRITEs between two processes (the probes themselves, their
# UCX log in a file of the doctor's own; or a child probe).
PROTO_OPS = {
    "read": "remote memory read by ucp_get*",
    "write": "remote memory write by ucp_put*",
    "messages": "active message by ucp_am_send*",
}
_UCX_LANE = re.compile(r"([a-z][a-z0-9_]*)/([A-Za-z0-9_.:-]+)")
_ASK_TIMEOUT_S = 90.0


def parse_proto_info(text: str) -> dict[str, list[str]]:
    """UCX_PROTO_INFO tables -> {"read"/"write"/"messages": the transport/device lanes UCX chose for
    that operation from host memory, in the order first seen}."""
    out: dict[str, list[str]] = {op: [] for op in PROTO_OPS}
    current: str | None = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]  # the table's cells, the log prefix dropped
        if len(cells) == 1:  # a table header line: the context and cfg, or the operation
            head = cells[0]
            if " by ucp_" in head:
                current = next((op for op, name in PROTO_OPS.items() if head.startswith(name) and "host memory" in head), None)
            continue
        if current is None or len(cells) != 3 or cells[0] == "Range":
            continue
        for transport, device in _UCX_LANE.findall(cells[2]):
            lane = f"{transport}/{device}"
            if lane not in out[current]:
                out[current].append(lane)
    return out


_WITHIN_HOST_TLS = ("cma", "sysv", "posix", "xpmem", "knem", "self", "cuda_ipc", "cuda_copy", "rocm_ipc", "memory")


def network_only(selected: dict[str, Any]) -> list[str]:
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
        "import json; from kv_connectors.doctor.local_probe import probe_local; "
        "print(json.dumps(probe_local([('nixl', False)], 0.0, 1, 1 << 20)['nixl']))"
    )
    answer = _ask_ucx(code, loopback=True)
    return answer if "error" in answer else {op: answer[op] for op in PROTO_OPS}


@contextlib.contextmanager
def proto_info_log() -> Iterator[Path]:
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


def selected_in(folder: Path) -> dict[str, Any]:
    logs = "".join(f.read_text(errors="replace") for f in sorted(folder.glob("ucx.*")))
    chosen = parse_proto_info(logs)
    if not chosen["read"] and not chosen["write"]:
        return {"error": "UCX printed no protocol tables (UCX_PROTO_INFO needs UCX 1.14 or later)"}
    return dict(chosen)


def ask_peer(host: str, port: int) -> dict[str, Any]:
    """Ask UCX which transports carry KV to the `doctor --serve` at host:port (a NIXL READ and WRITE
    from a child with UCX_PROTO_INFO=y, in this environment): {"read", "write", "messages": lanes,
    "read_gbps", "write_gbps"}, or {"error": why}."""
    code = (
        f"import json; from kv_connectors.doctor.peerprobe import probe_remote; print(json.dumps(probe_remote({host!r}, {port:d})))"
    )
    return _ask_ucx(code, loopback=False)
