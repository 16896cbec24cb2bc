"""Switching from vLLM's built-in NixlConnector: a launch script that sets only the built-in's
side-channel env vars (distinct per instance, as its docs show: P on a port, D on the next one) and
keeps its extra-config keys, adding our `kv_connector_module_path`, comes up and serves greedy-exact
through the proxy, with P at tensor-parallel size 2 (its rank 1 must not take D's port) and both
instances `kv_both`, as vLLM's guide launches them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvc_testing.cluster import MODULE_FORM, ProxyProcess, generate
from kvc_testing.procs import VllmServer, free_port_range, running
from tests.e2e.checks import PROMPTS, assert_pd_matches_colocated
from tests.e2e.conftest import MAX_MODEL_LEN


def _builtin_style(model, role: str, name: str, port: int, tp: int = 1, **extra: object) -> VllmServer:
    keys = {"backends": ["UCX"], "enforce_handshake_compat": True, **extra}
    ktc = {**MODULE_FORM, "kv_role": role, "kv_connector_extra_config": keys}
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
    args = ["--kv-transfer-config", json.dumps(ktc)] + (["--tensor-parallel-size", str(tp)] if tp > 1 else [])
    server = VllmServer(
        model,
        extra_args=args,
        extra_env=env,
        name=name,
        max_model_len=MAX_MODEL_LEN,
        **({"multiprocessing": True, "cpu_bind": "0|0", "ready_cpus": "0"} if tp > 1 else {}),
    )
    server.side_channel_port = port  # type: ignore[attr-defined]  # where kvc_testing's stats() asks
    return server


def _engine_affinity(server_pid: int) -> dict[str, set[int]]:
    """Thread name -> CPUs allowed, for every thread of the server's engine-core process."""
    todo, engine = [server_pid], None
    while todo and engine is None:
        pid = todo.pop()
        if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor"):
            engine = pid
        for task in Path(f"/proc/{pid}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
    assert engine is not None, "no engine-core process under the server"
    out: dict[str, set[int]] = {}
    for task in Path(f"/proc/{engine}/task").iterdir():
        out.setdefault((task / "comm").read_text().strip(), set()).update(os.sched_getaffinity(int(task.name)))
    main = Path(f"/proc/{engine}/task/{engine}")
    out["engine thread"] = os.sched_getaffinity(int(main.name))
    return out


def test_builtin_side_channel_env_vars_and_keys_work(tiny_model, reference):
    p_port = free_port_range(2)  # vLLM's guide: P on 5600, D on 5601
    # P's TP workers on core 0: they spin between steps and would starve D on shared cores (test_pd_tp)
    # kv_both on each, as vLLM's guide launches the built-in: the proxy's params decide who does what
    p = _builtin_style(tiny_model, "kv_both", "P-builtin-env", p_port, tp=2)
    # engine_cpus "builtin": D's engine thread pinned where the built-in pins its own on CPU
    d = _builtin_style(tiny_model, "kv_both", "D-builtin-env", p_port + 1, engine_cpus="builtin")
    with running(p, d), ProxyProcess([p.url], [d.url]) as proxy:
        proxy.wait_ready()
        assert_pd_matches_colocated(reference, p, d, proxy, prompts=PROMPTS[:4], p_tp=2)
        allowed = os.sched_getaffinity(0)
        d_threads, p_threads = _engine_affinity(d.pid), _engine_affinity(p.pid)
        assert d_threads["engine thread"] == {max(allowed)}, d_threads
        assert {max(allowed)} in [cpus for name, cpus in d_threads.items() if name.startswith("ZMQbg")], d_threads
        assert p_threads["engine thread"] == os.sched_getaffinity(p.pid), p_threads  # P left alone (the default)
        assert "has no effect" in p.log_path.read_text(errors="replace")  # enforce_handshake_compat, said aloud
        # P advertises the side channel its env var named (last: this leaves a lease held on P).
        params = generate(p.url, PROMPTS[5], 1, kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p_port)
