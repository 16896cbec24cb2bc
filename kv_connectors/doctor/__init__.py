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
With `--peer HOST:PORT`, where a `doctor --serve` listens (peerprobe.py), UCX is asked
instead: a short READ and WRITE to it with UCX_PROTO_INFO=y, the lanes UCX chose and the GB/s moved.

This package's face: the names the CLI, tests and docs use, from the modules that do the work, each
importing only those below it: command (the report, `--serve`) -> peers (`--peer`), advice (the
recommendation), render (text) -> facts (versions, devices, sysfs, UCX's environment), ucxinfo (what
UCX says it chose) -> local_probe (two processes here), peerprobe (two hosts) -> timing (the measured
READs and WRITEs).
"""

from kv_connectors.doctor.advice import MARGIN, beats, recommend, transfer_configs
from kv_connectors.doctor.command import diagnose, exit_status, probe_all, run, serve
from kv_connectors.doctor.facts import devices, known_problems, transparent_huge_pages, ucx, versions
from kv_connectors.doctor.peers import peer_path, route
from kv_connectors.doctor.render import render
from kv_connectors.doctor.ucxinfo import ask_peer, parse_proto_info, ucx_selection

__all__ = [
    "MARGIN",
    "ask_peer",
    "beats",
    "devices",
    "diagnose",
    "exit_status",
    "known_problems",
    "parse_proto_info",
    "peer_path",
    "probe_all",
    "recommend",
    "render",
    "route",
    "run",
    "serve",
    "transfer_configs",
    "transparent_huge_pages",
    "ucx",
    "ucx_selection",
    "versions",
]
