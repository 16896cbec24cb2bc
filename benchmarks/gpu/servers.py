"""The GPU check's servers (benchmarks/gpu/steps.py): every set-up's vLLM instances on one GPU
(ours over NIXL, pushing, staged, Mooncake, a perturbed P, a P under CUDA graphs; vLLM's built-in;
a colocated reference), their proxies, and the plan's own check (config keys as start-up reads
them, flags, ports, the GPU memory they ask for). Started once, shared by the checks."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shlex
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLACEHOLDER_MODEL = Path("<tiny model>")
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 64 << 20
D_TIMEOUTS = {"handshake_timeout_s": 5, "transfer_timeout_s": 10}
# A pool of 4 blocks of the tiny model (32 KiB each): the longest prompts go through in chunks.
STAGING = {"staging": "on", "staging_pool_kib": 128, "staging_chunk_kib": 32}


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """One vLLM server: our connector in `form` (a kvc_testing.cluster form), vLLM's built-in, or none."""

    key: str
    role: str  # kv_producer, kv_consumer, or "" (colocated)
    form: str = ""  # "nixl" / "mooncake" module path (P) or entry point (D); "builtin"; "" none
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model: str = "tiny"  # or "perturbed"
    graphs: bool = False  # vLLM's CUDA graphs (no --enforce-eager): compiled, slower to start


SERVERS = (
    ServerSpec("ref", ""),
    ServerSpec("P", "kv_producer", "nixl"),
    ServerSpec("D-pull", "kv_consumer", "nixl", {"mode": "pull", **D_TIMEOUTS}),
    ServerSpec("D-push", "kv_consumer", "nixl", {"mode": "push", **D_TIMEOUTS}),
    ServerSpec("P-graphs", "kv_producer", "nixl", graphs=True),
    ServerSpec("P-staged", "kv_producer", "nixl", STAGING),
    ServerSpec("D-staged", "kv_consumer", "nixl", {**STAGING, "mode": "pull", **D_TIMEOUTS}),
    ServerSpec("P-mooncake", "kv_producer", "mooncake"),
    ServerSpec("D-mooncake", "kv_consumer", "mooncake", D_TIMEOUTS),
    ServerSpec("P-perturbed", "kv_producer", "nixl", model="perturbed"),
    ServerSpec("builtin-P", "kv_producer", "builtin"),
    ServerSpec("builtin-D", "kv_consumer", "builtin"),
)
UNSEEDED = ("--no-first-token-from-prefill",)
PROXIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "pull": ("P", "D-pull", ()),
    "pull-unseeded": ("P", "D-pull", UNSEEDED),
    "push": ("P", "D-push", ()),
    "staged": ("P-staged", "D-staged", ()),
    "mooncake": ("P-mooncake", "D-mooncake", ()),
    "builtin": ("builtin-P", "builtin-D", ()),
    "builtin-unseeded": ("builtin-P", "builtin-D", UNSEEDED),
}


class Skip(Exception):
    """The step cannot run here (a server it needs is down, vLLM missing): said, not a failure of it."""


@dataclasses.dataclass
class Ctx:
    args: argparse.Namespace
    stack: contextlib.ExitStack
    servers: dict[str, Any] = dataclasses.field(default_factory=dict)  # key -> VllmServer
    proxies: dict[str, Any] = dataclasses.field(default_factory=dict)  # key -> ProxyProcess
    down: dict[str, str] = dataclasses.field(default_factory=dict)  # server key -> why it is not up
    models: dict[str, Path] = dataclasses.field(default_factory=dict)
    wanted: set[str] = dataclasses.field(default_factory=set)  # the servers the selected steps need

    @property
    def dry(self) -> bool:
        return bool(self.args.dry_run)

    def up(self, *keys: str, wait_s: float = 0.0) -> list[Any]:
        """The servers (or proxies) a check needs, each ready (waiting up to wait_s for one still
        starting); Skip naming one that is not."""
        wait_s = wait_s or self.args.step_timeout - 5
        out = []
        for key in keys:
            if key in PROXIES:
                p, d, _ = PROXIES[key]
                self.up(p, d, wait_s=wait_s)
                if key not in self.proxies or self.proxies[key].pid is None:
                    raise Skip(f"proxy {key} was not started")
                out.append(self.proxies[key])
                continue
            if key in self.down:
                raise Skip(f"server {key} is not up: {self.down[key]}")
            if key not in self.servers:
                raise Skip(f"server {key} was not built (the servers step did not run)")
            server = self.servers[key]
            if getattr(server, "ready", False) is False:
                try:
                    server.wait_ready(timeout=max(1.0, wait_s))
                except RuntimeError as e:
                    self.down[key] = str(e)[-1500:]
                    raise Skip(f"server {key} did not start: {self.down[key]}") from None
                server.ready = True
            out.append(server)
        return out


# servers ------------------------------------------------------------------------------------------
def build_server(spec: ServerSpec, model: Path, args: argparse.Namespace) -> Any:
    from kvc_testing import cluster
    from kvc_testing.procs import VllmServer, free_port

    kw: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": KV_CACHE_BYTES, "dtype": args.dtype, "name": spec.key}
    if spec.form == "builtin":
        from benchmarks.e2e.configs import UCX_ENV

        port = free_port()
        env = {**UCX_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        cfg = {"kv_connector": "NixlConnector", "kv_role": spec.role, "kv_buffer_device": "cuda"}
        server = VllmServer(model, extra_args=["--kv-transfer-config", json.dumps(cfg)], extra_env=env, **kw)
        server.side_channel_port = port  # type: ignore[attr-defined]
    elif spec.form:
        forms = {
            ("nixl", "kv_producer"): cluster.MODULE_FORM,
            ("nixl", "kv_consumer"): cluster.ENTRY_POINT_FORM,
            ("mooncake", "kv_producer"): cluster.MOONCAKE_MODULE_FORM,
            ("mooncake", "kv_consumer"): cluster.MOONCAKE_ENTRY_POINT_FORM,
        }
        server = cluster.pd_server(model, spec.role, form=forms[spec.form, spec.role], extra_config=dict(spec.extra), **kw)
    else:
        server = VllmServer(model, **kw)
    # On the GPU: a share of it per server (vLLM checks that much is free at start-up).
    server.argv += ["--gpu-memory-utilization", f"{args.gpu_memory_utilization:g}"]
    if spec.graphs:
        server.argv.remove("--enforce-eager")
    return server


def plan_problems(ctx: Ctx) -> list[str]:
    """What is wrong with the servers' plan: our extra config (checked as start-up checks it), the
    flags, ports, and the GPU memory every server asks for."""
    from kv_connectors.config import TRANSPORT_DEFAULTS, parse_config
    from kv_connectors.errors import ConfigError

    problems: list[str] = []
    ports: list[int] = []
    for spec in SERVERS:
        server = ctx.servers[spec.key]
        argv = server.argv
        ports += [server.port] + ([server.side_channel_port] if spec.form else [])
        if ("--enforce-eager" in argv) == spec.graphs or "--gpu-memory-utilization" not in argv:
            problems.append(f"{spec.key}: --enforce-eager / --gpu-memory-utilization wrong in {argv}")
        if not spec.form:
            continue
        ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        if spec.form == "builtin":
            if ktc.get("kv_buffer_device") != "cuda":
                problems.append(f"{spec.key}: the built-in's KV buffer is not on the GPU: {ktc}")
            continue
        try:
            parse_config("dry-run", ktc["kv_role"], ktc["kv_connector_extra_config"], TRANSPORT_DEFAULTS[spec.form])
        except (ConfigError, KeyError) as e:
            problems.append(f"{spec.key}: {e}")
    ports += [p.port for p in ctx.proxies.values()]
    if len(set(ports)) != len(ports):
        problems.append(f"ports used twice: {sorted(ports)}")
    if len(SERVERS) * ctx.args.gpu_memory_utilization > 0.9:
        problems.append(f"{len(SERVERS)} servers x {ctx.args.gpu_memory_utilization} of the GPU each is more than 0.9 of it")
    return problems


def step_servers(ctx: Ctx) -> dict[str, Any]:
    from kvc_testing.cluster import ProxyProcess

    for spec in SERVERS:
        model = ctx.models.get(spec.model, PLACEHOLDER_MODEL)
        ctx.servers[spec.key] = build_server(spec, model, ctx.args)
    for key, (p, d, flags) in PROXIES.items():
        ctx.proxies[key] = ProxyProcess([ctx.servers[p].url], [ctx.servers[d].url], extra_args=flags)
    commands = [f"{k}: {shlex.join(s.argv)}" for k, s in ctx.servers.items()]
    commands += [f"proxy {k}: {shlex.join(p.argv)}" for k, p in ctx.proxies.items()]
    if ctx.dry:
        return {"commands": commands, "problems": plan_problems(ctx)}
    t0 = time.monotonic()
    deadline = t0 + ctx.args.step_timeout - 30  # what is left for the proxies
    wanted = ctx.wanted
    for key in wanted:
        ctx.servers[key].start()
        ctx.stack.callback(ctx.servers[key].stop)
    started: dict[str, float] = {}
    for spec in SERVERS:
        if spec.graphs or spec.key not in wanted:
            continue  # not needed; or compiling: awaited by the step that needs it
        with contextlib.suppress(Skip):
            ctx.up(spec.key, wait_s=deadline - time.monotonic())
            started[spec.key] = round(time.monotonic() - t0, 1)
    for key, proxy in ctx.proxies.items():
        p, d, _ = PROXIES[key]
        if p in started and d in started:
            proxy.start()
            ctx.stack.callback(proxy.stop)
            proxy.wait_ready()
    figures = {"ready_after_s": started, "down": dict(ctx.down), "not_needed": sorted(set(ctx.servers) - wanted)}
    if ctx.down:
        return {"commands": commands, "figures": figures, "error": f"not started: {', '.join(ctx.down)}"}
    return {"commands": commands, "figures": figures}
