"""P and D on two "hosts": separate network namespaces joined by a bridge, UCX restricted to TCP,
Mooncake on tcp, each side channel bound to and advertising its namespace's address. The proxy runs
in the root namespace. Greedy-exact for NIXL and Mooncake, pull and push; cutting P's link fails a
load within D's deadlines, and loads succeed again once the link is back."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kv_connectors import sidechannel
from kvc_testing import netns
from kvc_testing.cluster import (
    MODULE_FORM,
    MOONCAKE_MODULE_FORM,
    ProxyProcess,
    generate,
    make_prompts,
    output_ids,
    pd_server,
    wait_until,
)
from kvc_testing.procs import VllmServer, running
from tests.e2e.checks import MAX_TOKENS
from tests.e2e.conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.timeout(900)

# Each namespace has its own ports: P's first side channel and D's first are both this one.
SIDE_CHANNEL_PORT = 5710
UCX_OVER_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
D_DEADLINES = {"handshake_timeout_s": 5, "transfer_timeout_s": 10}


@pytest.fixture(scope="module")
def hosts() -> Iterator[netns.TwoHosts]:
    why = netns.available()
    assert why is None, why  # root and iproute2 are part of this project's machines (not a skip)
    with netns.two_hosts() as h:
        yield h


def _server(
    model, host: netns.Host, role: str, form: dict, name: str, port: int, server_kwargs: dict | None = None, **extra
) -> VllmServer:
    """port: its side channel's, in its namespace; extra: our kv_connector_extra_config keys;
    server_kwargs: VllmServer's (e.g. kv_cache_bytes)."""
    return pd_server(
        model,
        role,
        side_channel_port=port,
        form=form,
        name=name,
        host=host.address,
        netns=host.netns,
        extra_env=UCX_OVER_TCP,
        max_model_len=MAX_MODEL_LEN,
        extra_config={"side_channel_host": host.address, **extra},
        **(server_kwargs or {}),
    )


def _stats(host: netns.Host, server: VllmServer):
    return sidechannel.query_stats(host.address, server.side_channel_port)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def pairs(tiny_model, hosts) -> Iterator[dict[str, tuple[VllmServer, VllmServer, VllmServer]]]:
    """For NIXL and for Mooncake: P in P's namespace, a pulling and a pushing D in D's, each on a
    side-channel port of its own there; all six started together. P's lease is 5 s: the cut-link
    test waits for it to free what D could not read."""
    servers: dict[str, tuple[VllmServer, VllmServer, VllmServer]] = {}
    for i, (transport, form) in enumerate((("nixl", MODULE_FORM), ("mooncake", MOONCAKE_MODULE_FORM))):
        p = _server(tiny_model, hosts.p, "kv_producer", form, f"P-{transport}-netns", SIDE_CHANNEL_PORT + i, lease_s=5)
        pull = _server(
            tiny_model,
            hosts.d,
            "kv_consumer",
            form,
            f"D-{transport}-pull-netns",
            SIDE_CHANNEL_PORT + 2 * i,
            mode="pull",
            **D_DEADLINES,
        )
        push = _server(
            tiny_model,
            hosts.d,
            "kv_consumer",
            form,
            f"D-{transport}-push-netns",
            SIDE_CHANNEL_PORT + 2 * i + 1,
            mode="push",
            **D_DEADLINES,
        )
        servers[transport] = (p, pull, push)
    with running(*(s for trio in servers.values() for s in trio)):
        yield servers


def _exact_through_proxy(reference, p: VllmServer, d: VllmServer, hosts: netns.TwoHosts, prompts, pull: bool = False) -> None:
    """Greedy-exact through the proxy, every prompt loaded from P; pulled loads proved by P's lease
    words (one-sided reads over TCP too, no claim) where `pull`."""
    before = _stats(hosts.d, d)
    with ProxyProcess([p.url], [d.url]) as proxy:
        proxy.wait_ready()
        for prompt in prompts:
            expected = output_ids(generate(reference.url, prompt, MAX_TOKENS))
            assert output_ids(generate(proxy.url, prompt, MAX_TOKENS)) == expected, f"prompt of {len(prompt)} tokens"
    after = _stats(hosts.d, d)
    assert after.recv_transfers - before.recv_transfers == len(prompts), "D did not load every prompt from P"
    assert after.recv_bytes > before.recv_bytes and after.recv_failures == before.recv_failures
    if pull:
        assert after.reads_fenced_by_words - before.reads_fenced_by_words == len(prompts), (before, after)
    wait_until(lambda: _stats(hosts.p, p).held_blocks == 0, 15, "P to free the blocks D loaded")


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_greedy_exact_across_hosts_pull_and_push(reference, hosts, pairs, transport):
    p, pull, push = pairs[transport]
    _exact_through_proxy(reference, p, pull, hosts, make_prompts([40, 150, 333], seed=21), pull=True)
    # the same P serves a D that asks it to write
    _exact_through_proxy(reference, p, push, hosts, make_prompts([60, 200], seed=22))


def test_cut_link_fails_the_load_once_its_read_ended_and_recovers(reference, hosts, pairs):
    """P's link is cut with D's read in flight: no engine stops that read, so D keeps the request's
    blocks past its deadline (settling) instead of handing vLLM blocks the read could still land in.
    Once the link is back the read ends, D reports the load failed (an error, never a wrong answer),
    and loads succeed again."""
    p, d, _ = pairs["nixl"]
    _exact_through_proxy(reference, p, d, hosts, make_prompts([100], seed=23))  # connected before the cut
    prompt = make_prompts([180], seed=24)[0]
    params = generate(p.url, prompt, 1, kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
    settled_before = _stats(hosts.d, d).settled_loads
    restore_after = D_DEADLINES["handshake_timeout_s"] + D_DEADLINES["transfer_timeout_s"] + 5
    hosts.p.cut()
    restorer = threading.Timer(restore_after, hosts.p.restore)
    restorer.start()
    try:
        started = time.monotonic()
        r = generate(d.url, prompt, MAX_TOKENS, timeout=180, kv_transfer_params=params)
        elapsed = time.monotonic() - started
        assert r.status_code != 200 or "error" in r.text.lower(), f"D answered a load it could not do: {r.text[:300]}"
        assert elapsed >= restore_after - 1, f"D reported the load failed after {elapsed:.1f} s, with its read still moving"
        assert elapsed < restore_after + 60, f"D took {elapsed:.1f} s to fail the load once the link was back"
        after = _stats(hosts.d, d)
        assert after.recv_failures >= 1 and after.settled_loads > settled_before, after
    finally:
        restorer.cancel()
        hosts.p.restore()
    # P frees the unread blocks at its lease; loads work again over the restored link.
    wait_until(lambda: _stats(hosts.p, p).held_blocks == 0, 30, "P to free the blocks after the lease")
    _exact_through_proxy(reference, p, d, hosts, make_prompts([90, 260], seed=25))


def _doctor_in(host: netns.Host, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        ["ip", "netns", "exec", host.netns, sys.executable, "-m", "kv_connectors", "doctor", "--no-probe", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_doctor_on_d_names_the_interface_and_transport_that_reach_p(hosts):
    """From D's namespace: P is reached over TCP through eth0 (no RDMA there), its own address is
    this host, a UCX_NET_DEVICES of lo is called out, and an address nobody routes is exit 2."""
    code, r = _doctor_in(hosts.d, "--peer", hosts.p.address, "--peer", hosts.d.address)
    assert code == 0, r
    to_p, to_self = r["peers"]
    assert (to_p["interface"], to_p["transport"]) == ("eth0", "tcp over eth0"), to_p
    assert any(f"transfers to {hosts.p.address} go over TCP" in w for w in r["recommendation"]["warnings"])
    assert to_self["transport"].startswith("cma/shm"), to_self
    code, r = _doctor_in(hosts.d, "--peer", hosts.p.address, env={"UCX_NET_DEVICES": "lo"})
    assert code == 0 and any("UCX_NET_DEVICES=lo does not include eth0" in w for w in r["peers"][0]["warnings"]), r
    code, r = _doctor_in(hosts.d, "--peer", "203.0.113.9")  # the namespace has no default route
    assert code == 2 and "no route to 203.0.113.9" in r["peers"][0]["error"], r


@pytest.mark.parametrize(("transport", "mode"), [("nixl", "pull"), ("nixl", "push"), ("mooncake", "push")])
def test_bench_transport_moves_verified_bytes_between_the_namespaces(transport, mode):
    """bench_transport --two-hosts: P's process in P's namespace, D (the benchmark) in D's, UCX on
    eth0, the raw TCP baseline across the same veth pairs; the bytes are verified by the benchmark."""
    import json
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "benchmarks.transport.bench_transport", "--two-hosts", "--tcp-baseline", "--json"]
    argv += ["--transport", transport, "--mode", mode, "--size-mib", "16", "--repeat", "2", "--latency-samples", "3"]
    if transport == "mooncake":
        argv += ["--mooncake-protocol", "tcp"]
    env = {**os.environ, "UCX_TLS": "tcp"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["path"].startswith("two hosts") and r["mode"] == mode
    assert r["gbps"] > 0 and r["tcp_gbps"] > 0 and r["ratio_tcp"] > 0, r
    assert "raw TCP, P's namespace to D's" in proc.stdout


def test_doctor_asks_ucx_across_the_namespaces_through_a_doctor_serve_on_p(hosts):
    """`doctor --serve` in P's namespace, `doctor --peer P:PORT` in D's: UCX's own answer for the path
    between the hosts (tcp over eth0 under UCX_TLS=tcp, bytes moved and verified); with D's
    UCX_NET_DEVICES=lo UCX cannot reach P, and that is exit 2 with the reason, within the deadlines."""
    from kv_connectors.doctor.peerprobe import SERVING
    from kvc_testing.procs import ManagedProcess

    argv = ["ip", "netns", "exec", hosts.p.netns, sys.executable, "-m", "kv_connectors", "doctor"]
    with ManagedProcess([*argv, "--serve", f"{hosts.p.address}:5799", "--serve-s", "300"], name="doctor-serve-p") as server:
        server.wait_log(SERVING, 60)
        code, r = _doctor_in(hosts.d, "--peer", f"{hosts.p.address}:5799", env={"UCX_TLS": "tcp"})
        assert code == 0, r
        (to_p,) = r["peers"]
        assert to_p["interface"] == "eth0" and to_p["asked"]["read"] == ["tcp/eth0"], to_p
        assert set(to_p["asked"]["write"]) == {"tcp/eth0"} and to_p["asked"]["read_gbps"] > 0, to_p
        assert any("UCX chose tcp/eth0" in w for w in r["recommendation"]["warnings"]), r["recommendation"]
        started = time.monotonic()
        code, r = _doctor_in(hosts.d, "--peer", f"{hosts.p.address}:5799", env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"})
        error = r["peers"][0]["error"]
        assert code == 2 and "UCX moved no KV to the doctor --serve" in error and "refused" in error, r
        assert time.monotonic() - started < 100
        assert server.is_running(), server.log_tail()


BLOCK_BYTES = 32 * 1024  # the tiny model: 32 tokens x 2 layers x 2 KV heads x 32 x K,V x float32
D_BLOCKS = 17  # one max_model_len request (16 blocks) and one more: a failed load's blocks go to the next


def test_a_transfer_that_outlives_ds_deadline_never_lands_in_blocks_another_request_got(tiny_model, reference, hosts):
    """The link to P is slowed (a tc token bucket) so that a long prompt's read outlives D's 3 s deadline.
    D's cache holds 17 blocks: once the failed load's 13 blocks are free, the next request (B) gets
    most of them, and a third (C) with B's prompt hits B's cached blocks. No engine stops the
    abandoned read: had vLLM been told at the deadline, its bytes would land in B's blocks as they
    keep arriving (C would then decode from another prompt's KV). D settles first: B and C decode
    exactly as colocated, and A fails cleanly."""
    # side channels past the module's six servers' (still running)
    p = _server(tiny_model, hosts.p, "kv_producer", MODULE_FORM, "P-slow-netns", SIDE_CHANNEL_PORT + 2, lease_s=120)
    d = _server(
        tiny_model,
        hosts.d,
        "kv_consumer",
        MODULE_FORM,
        "D-slow-netns",
        SIDE_CHANNEL_PORT + 4,
        server_kwargs={"kv_cache_bytes": D_BLOCKS * BLOCK_BYTES},
        handshake_timeout_s=5,
        transfer_timeout_s=3,
    )
    a_prompt, b_prompt = make_prompts([400, 400], seed=31)
    with running(p, d):
        _exact_through_proxy(reference, p, d, hosts, make_prompts([40], seed=30))  # hand-shaken before the slow-down
        params = generate(p.url, a_prompt, 1, kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
        b_expected = output_ids(generate(reference.url, b_prompt, MAX_TOKENS))
        netns.slow(hosts.p, rate="400kbit")  # ~400 KB of KV: ~8 s, past D's 3 s deadline
        try:
            settled_before = _stats(hosts.d, d).settled_loads
            results: dict[str, object] = {}

            def load_a() -> None:
                results["a"] = generate(d.url, a_prompt, MAX_TOKENS, timeout=120, kv_transfer_params=params)

            a = threading.Thread(target=load_a)
            a.start()
            time.sleep(3.5)  # D's deadline passed; the read is still arriving
            b = generate(d.url, b_prompt, MAX_TOKENS, timeout=120)
            a.join(120)
            time.sleep(2)  # whatever of A's read was still on its way has landed by now
            c = generate(d.url, b_prompt, MAX_TOKENS, timeout=120)
        finally:
            netns.unslow(hosts.p)
        ra = results.get("a")
        assert ra is not None and (ra.status_code != 200 or "error" in ra.text.lower()), "D answered a load that failed"
        assert output_ids(b) == b_expected, "B decoded from blocks an abandoned read was still writing"
        assert output_ids(c) == b_expected, "C hit B's cached blocks, overwritten by an abandoned read"
        assert _stats(hosts.d, d).settled_loads > settled_before, "the failed load did not settle (was it failed at all?)"
