"""A 1P1D disaggregated set-up on this host (P, D, proxy, optional colocated reference) for demo, tests, benchmarks."""

from __future__ import annotations

import json
import logging
import random
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from kv_connectors import sidechannel, wire
from kvc_testing.procs import ManagedProcess, VllmServer, free_port, free_port_range

logger = logging.getLogger(__name__)

PROXY_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "proxy.py"


def proxy_command() -> list[str]:
    """The installed `kv-connectors-proxy` command (pip install -e '.[proxy]'; `make setup` does)."""
    command = Path(sys.executable).with_name("kv-connectors-proxy")
    if not command.exists():
        raise RuntimeError(f"{command} is missing: install the package with its proxy extra (make setup)")
    return [str(command)]


# The two ways users load our connector: vLLM's module-path form and our entry-point name.
MODULE_FORM = {"kv_connector": "NixlConnector", "kv_connector_module_path": "kv_connectors.nixl"}
ENTRY_POINT_FORM = {"kv_connector": "KvcNixlConnector"}
MOONCAKE_MODULE_FORM = {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connectors.mooncake"}
MOONCAKE_ENTRY_POINT_FORM = {"kv_connector": "KvcMooncakeConnector"}


def kv_transfer_config(
    role: str,
    side_channel_port: int,
    *,
    form: Mapping[str, str] = MODULE_FORM,
    top_level: Mapping[str, Any] | None = None,
    **extra: Any,
) -> str:
    """The --kv-transfer-config JSON for one instance; top_level: vLLM's own keys (e.g.
    kv_load_failure_policy, engine_id), extra: kv_connector_extra_config."""
    cfg: dict[str, Any] = {**dict(form), **dict(top_level or {})}
    cfg["kv_role"] = role
    cfg["kv_connector_extra_config"] = {"side_channel_port": side_channel_port, **extra}
    return json.dumps(cfg)


def kv_events_args(port: int, topic: str) -> list[str]:
    """vLLM's --kv-events-config: a ZMQ publisher bound on PORT (tcp://*: binds, a host connects)."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": topic}
    return ["--kv-events-config", json.dumps(cfg)]


def pd_server(
    model: str | Path,
    role: str,
    *,
    side_channel_port: int | None = None,
    form: Mapping[str, str] = MODULE_FORM,
    cpu_bind: int | None = None,
    name: str | None = None,
    extra_config: Mapping[str, Any] | None = None,
    transfer_config: Mapping[str, Any] | None = None,
    tp: int = 1,
    dp: int = 1,
    extra_args: Sequence[str] = (),
    **server_kwargs: Any,
) -> VllmServer:
    """A vLLM server with our connector (not started). transfer_config: vLLM's own kv-transfer-config
    keys (e.g. {"kv_load_failure_policy": "recompute"}); extra_config: ours. tp > 1: that many
    tensor-parallel ranks, one core each (worker processes; rank 0's side channel names the others');
    dp > 1: that many data-parallel engines (engine d's side channel on port + d); extra_args: more
    vLLM flags (e.g. --kv-events-config)."""
    port = side_channel_port or (free_port() if dp == 1 else free_port_range(dp))
    ktc = kv_transfer_config(role, port, form=form, top_level=transfer_config, **dict(extra_config or {}))
    args = ["--kv-transfer-config", ktc]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    if dp > 1:
        args += ["--data-parallel-size", str(dp)]
    args += [str(a) for a in extra_args]
    if tp > 1 or dp > 1:
        server_kwargs["multiprocessing"] = True
        cpu_bind = cpu_bind if cpu_bind is not None else "|".join(str(r % 2) for r in range(tp * dp))
    server = VllmServer(
        model,
        extra_args=args,
        cpu_bind=cpu_bind,
        name=name or role,
        **server_kwargs,
    )
    server.side_channel_port = port  # type: ignore[attr-defined]
    return server


class ProxyProcess(ManagedProcess):
    """The proxy (the installed `kv-connectors-proxy` command) as a child process.

    `prefill_side_channels` (one per prefill URL, None for none) become `--prefill URL SIDE_CHANNEL`;
    `extra_args` are more proxy flags (e.g. `["--flow", "transfer-id", "--health-interval-s", "0.5"]`);
    `env` the whole environment (e.g. with KVC_PROXY_ADMIN_TOKEN), inherited when None."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        port: int | None = None,
        *,
        prefill_side_channels: Sequence[str | int | None] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        side_channels = [None] * len(prefill_urls) if prefill_side_channels is None else list(prefill_side_channels)
        if len(side_channels) != len(prefill_urls):
            raise ValueError("prefill_side_channels needs one entry per prefill URL")
        argv = [*proxy_command(), "--port", str(self.port)]
        for u, side_channel in zip(prefill_urls, side_channels):
            argv += ["--prefill", u] + ([] if side_channel is None else [str(side_channel)])
        for u in decode_urls:
            argv += ["--decode", u]
        argv += [str(a) for a in extra_args]
        super().__init__(argv, name=f"proxy-{self.port}", env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> ProxyProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                raise RuntimeError(f"proxy exited: {self.log_tail(30)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"proxy not ready after {timeout:.0f} s: {self.log_tail(30)}")


def make_prompts(lengths: Sequence[int], vocab_size: int = 1024, seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts of the given lengths (ids above the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(n)] for n in lengths]


def generate(
    url: str, prompt: list[int] | str, max_tokens: int, timeout: float = 120.0, *, client: httpx.Client | None = None, **extra: Any
) -> httpx.Response:
    """Greedy /v1/completions returning token ids; the raw response (status not checked). Pass a
    kept-alive client where the call is timed: a new one loads the CA bundle (~20 ms here)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **extra}
    if client is not None:
        return client.post(f"{url}/v1/completions", json=body, timeout=timeout)
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def output_ids(response: httpx.Response) -> list[int]:
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.url} -> {response.status_code}: {response.text[:500]}")
    return list(response.json()["choices"][0]["token_ids"])


def prefill(p_url: str, prompt: list[int] | str, timeout: float = 120.0) -> dict[str, Any]:
    """What the proxy does first: a 1-token request to P asking it to keep the KV for a D."""
    r = generate(
        p_url,
        prompt,
        1,
        timeout=timeout,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    if r.status_code != 200:
        raise RuntimeError(f"prefill -> {r.status_code}: {r.text[:500]}")
    params = r.json().get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"prefill answered without kv_transfer_params: {r.text[:500]}")
    return params


def transfer_id_params(prefill_server: VllmServer, transfer_id: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The transfer-id flow's (P, D) kv_transfer_params: one id on both, P's side channel for D."""
    transfer_id = transfer_id or "kvc-" + uuid.uuid4().hex
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    d_params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_host": "127.0.0.1",
        "remote_port": prefill_server.side_channel_port,
    }  # type: ignore[attr-defined]
    return p_params, d_params


def stats(server: VllmServer, timeout_s: float = 5.0, rank: int = 0, dp: int = 0) -> wire.StatsReply:
    """Our connector's counters on one server's tensor-parallel rank of data-parallel engine `dp`
    (via that rank's side channel: rank 0 names the others, config.PortLayout)."""
    first = sidechannel.query_stats("127.0.0.1", server.side_channel_port + dp, timeout_s)  # type: ignore[attr-defined]
    if rank == 0:
        return first
    if not first.ranks:  # an older version, which names no ranks: rank r at port + r
        return sidechannel.query_stats("127.0.0.1", server.side_channel_port + rank, timeout_s)  # type: ignore[attr-defined]
    host, port = sidechannel.parse_address(first.ranks[rank])
    return sidechannel.query_stats(host, port, timeout_s)


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll predicate() until truthy; raise AssertionError naming what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def metric(url: str, name: str, *, missing_ok: bool = False) -> float:
    """Sum of a Prometheus metric's samples on a vLLM server's /metrics.

    A metric the server does not export is an error (a check must not pass because a metric is
    missing), unless missing_ok (metrics some servers create only on first use): then 0."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and len(line) > len(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found and not missing_ok:
        raise AssertionError(f"{url}/metrics has no {name!r}")
    return total


def labelled(url: str, name: str, labels: dict[str, str]) -> float:
    """Sum of a metric's samples on a server's /metrics that carry these labels (an error if none does)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    found = [
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        if line.startswith(name + "{") and all(w in line.split("}", 1)[0] for w in want)
    ]
    assert found, f"{url}/metrics has no {name}{labels}"
    return sum(found)
