"""Switching from vLLM's built-in NixlConnector: a launch script that sets only the built-in's
side-channel env vars (distinct per instance, as its docs show) and keeps its extra-config keys,
adding our `kv_connector_module_path`, comes up and serves greedy-exact through the proxy."""

from __future__ import annotations

import json

from kvc_testing.cluster import MODULE_FORM, ProxyProcess, generate
from kvc_testing.procs import VllmServer, free_port
from tests.e2e.checks import PROMPTS, assert_pd_matches_colocated
from tests.e2e.conftest import MAX_MODEL_LEN


def _builtin_style(model, role: str, name: str) -> tuple[VllmServer, int]:
    port = free_port()
    ktc = {**MODULE_FORM, "kv_role": role, "kv_connector_extra_config": {"backends": ["UCX"], "enforce_handshake_compat": True}}
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
    server = VllmServer(
        model, extra_args=["--kv-transfer-config", json.dumps(ktc)], extra_env=env, name=name, max_model_len=MAX_MODEL_LEN
    )
    server.side_channel_port = port  # type: ignore[attr-defined]  # where kvc_testing's stats() asks
    return server, port


def test_builtin_side_channel_env_vars_and_keys_work(tiny_model, reference):
    p, p_port = _builtin_style(tiny_model, "kv_producer", "P-builtin-env")
    d, _ = _builtin_style(tiny_model, "kv_consumer", "D-builtin-env")
    with p, d, ProxyProcess([p.url], [d.url]) as proxy:
        proxy.wait_ready()
        assert_pd_matches_colocated(reference, p, d, proxy, prompts=PROMPTS[:4])
        assert "has no effect" in p.log_path.read_text(errors="replace")  # enforce_handshake_compat, said aloud
        # P advertises the side channel its env var named (last: this leaves a lease held on P).
        params = generate(p.url, PROMPTS[5], 1, kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p_port)
