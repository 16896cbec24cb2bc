"""Two hosts on one machine: P and D in their own network namespaces, joined by a bridge in the root
namespace (where the proxy and the test run), each over a veth pair with addresses the test assigns.

The deployment users run across nodes without RDMA: every byte between P and D crosses a network
device (TCP), nothing is shared through 127.0.0.1. Needs root and `ip` (iproute2).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Host:
    netns: str
    address: str
    link: str  # the root-side end of its veth pair: set it down to cut the host off

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")


def slow(host: Host, rate: str) -> None:
    """Slow what the host sends to at most `rate` (e.g. "400kbit"): a token bucket (tc tbf) on its
    eth0, queueing up to 10 s of traffic rather than dropping it (netem is not in every kernel)."""
    _tc(host, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "16kb", "latency", "10s")


def unslow(host: Host) -> None:
    with contextlib.suppress(RuntimeError):
        _tc(host, "qdisc", "del", "dev", "eth0", "root")


def _tc(host: Host, *args: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", host.netns, "tc", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {host.netns}: {proc.stderr.strip()}")


@dataclasses.dataclass(frozen=True)
class TwoHosts:
    p: Host
    d: Host
    gateway: str  # the bridge's address, in the root namespace


def available() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    return None


_CLONE_NEWNET = 0x40000000


def _setns(fd: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into {what}: {os.strerror(err)}")


def enter(name: str) -> None:
    """Move the calling thread into network namespace `name` (`ip netns add` made it); threads and
    processes it starts from then on are born there. For a process of its own (a benchmark peer)."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(fd, name)
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside(name: str) -> Iterator[None]:
    """The calling thread in namespace `name` while inside, back in its own namespace after."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(name)
        try:
            yield
        finally:
            _setns(home, "the namespace this thread came from")
    finally:
        os.close(home)


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")


def _free_tag() -> int:
    """A tag (20..219, from this process's id on) whose bridge and namespaces nobody has made: two
    processes may each set up two hosts at once (a test and the benchmark it runs)."""
    start = os.getpid() % 200
    for i in range(200):
        tag = (start + i) % 200 + 20
        taken = os.path.exists(f"/sys/class/net/kvcbr{tag}") or any(
            os.path.exists(f"/var/run/netns/kvc-{role}-{tag}") for role in ("p", "d")
        )
        if not taken:
            return tag
    raise RuntimeError("no free tag for two hosts (200 bridges kvcbr20..219 exist)")


@contextlib.contextmanager
def two_hosts(tag: int | None = None) -> Iterator[TwoHosts]:
    """Bridge kvcbr<tag> (10.213.<tag>.1/24), namespaces kvc-p-<tag> (.2) and kvc-d-<tag> (.3), each
    with an `eth0` and loopback up; everything is removed on exit."""
    tag = tag if tag is not None else _free_tag()
    bridge, net = f"kvcbr{tag}", f"10.213.{tag}"
    hosts = {role: Host(f"kvc-{role}-{tag}", f"{net}.{i}", f"kvc{role}{tag}") for i, role in ((2, "p"), (3, "d"))}
    made: list[tuple[str, ...]] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made.append(("link", "del", bridge))
        _ip("addr", "add", f"{net}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for host in hosts.values():
            _ip("netns", "add", host.netns)
            made.append(("netns", "del", host.netns))
            _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            made.append(("link", "del", host.link))
            _ip("link", "set", host.link, "master", bridge, "up")
            _ip("link", "set", "lo", "up", netns=host.netns)
            _ip("link", "set", "eth0", "up", netns=host.netns)
            _ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
        yield TwoHosts(hosts["p"], hosts["d"], f"{net}.1")
    finally:
        for args in reversed(made):
            with contextlib.suppress(RuntimeError):
                _ip(*args)
