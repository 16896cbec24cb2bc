"""The set-ups bench_e2e.py compares: how each configuration's servers are built (ours, vLLM's built-in, colocated)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvc_testing.cluster import MODULE_FORM, MOONCAKE_MODULE_FORM, pd_server
from kvc_testing.procs import MiB, VllmServer, free_port
from kvc_testing.tiny_model import kv_bytes_per_token, max_positions

COLOCATED = "colocated"
BUILTIN = "builtin-nixl"
BLOCK_SIZE = 32
MIN_KV_CACHE_BYTES = 64 * MiB
# Staging pool = this fraction of the KV cache (issue 5's bound on staging host memory).
STAGING_POOL_FRACTION = 8
MAX_STAGING_CHUNK_KIB = 1024
# What our NIXL transport sets for itself (loopback, no ib modules); the built-in gets the same.
UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib,rdmacm"}
# The built-in connector as shipped: nixl_agent creates its progress thread with pthrDelay 0.
BUILTIN_NOTE = (
    "vLLM's built-in NixlConnector as shipped: nixl_agent hard-codes the progress-thread poll delay "
    "(pthrDelay) to 0, so each of P's and D's NIXL progress threads spins a whole core"
)
PATCHED_NOTE = (
    "vLLM's built-in NixlConnector with NIXL's progress-thread poll delay set to {delay_us} us by "
    "benchmarks/e2e/builtin_launcher.py wrapping nixl's bindings (vLLM's files untouched; not how it ships)"
)
BUILTIN_LAUNCHER = Path(__file__).resolve().parent / "builtin_launcher.py"
PROGRESS_DELAY_ENV = "KVC_BENCH_NIXL_PROGRESS_DELAY_US"  # read by builtin_launcher.py
# ours-nixl-pull-baseline: a checkout of an earlier kv-connectors, run in the same benchmark as this one.
BASELINE_TREE_ENV = "KVC_BENCH_BASELINE_TREE"


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What every server of one run shares: model, lengths that must fit, KV cache size."""

    model: Path
    variant: str
    max_model_len: int
    kv_cache_bytes: int
    block_size: int = BLOCK_SIZE
    p_cpus: str | None = None  # --pin: P's servers on these cores (taskset), D's and colocated on d_cpus
    d_cpus: str | None = None

    @property
    def staging(self) -> dict[str, Any]:
        """extra_config of ours-nixl-staging: a pool of 1/8 of the KV cache, at least two chunks."""
        pool_kib = max(2 * 16, self.kv_cache_bytes // 1024 // STAGING_POOL_FRACTION)
        chunk_kib = max(16, min(MAX_STAGING_CHUNK_KIB, pool_kib // 4))
        return {"staging": "on", "staging_pool_kib": pool_kib, "staging_chunk_kib": chunk_kib}

    def server_kwargs(self, role: str = "D") -> dict[str, Any]:
        """VllmServer keywords for a P ("P") or a D or colocated server ("D"), pinned where --pin says."""
        kw: dict[str, Any] = {
            "max_model_len": self.max_model_len,
            "kv_cache_bytes": self.kv_cache_bytes,
            "block_size": self.block_size,
        }
        cpus = self.p_cpus if role == "P" else self.d_cpus
        if cpus is not None:
            kw["cpus"] = cpus
        return kw


def settings_for(model: Path, variant: str, longest_prompt: int, max_tokens: int, concurrency: int) -> ServerSettings:
    """Server settings fitting the longest prompt plus output, for `concurrency` requests in flight.

    The KV cache holds twice the tokens in flight (P keeps blocks until D has them); at least 64 MiB.
    """
    need = longest_prompt + max_tokens
    limit = max_positions(variant)
    if need > limit:
        raise ValueError(
            f"longest prompt {longest_prompt} + max tokens {max_tokens} = {need} exceeds the {variant} model's "
            f"{limit} positions; use shorter --lengths or a larger --model-size"
        )
    max_model_len = min(limit, -(-need // BLOCK_SIZE) * BLOCK_SIZE)
    tokens = 2 * concurrency * (max_model_len + BLOCK_SIZE)
    kv = max(MIN_KV_CACHE_BYTES, -(-tokens * kv_bytes_per_token(variant) // MiB) * MiB)
    return ServerSettings(model, variant, max_model_len, kv)


@dataclasses.dataclass(frozen=True)
class PdConfig:
    """One disaggregated configuration: how to build its P and D (not started)."""

    name: str
    description: str
    build: Callable[[ServerSettings], tuple[VllmServer, VllmServer]]
    kv_source: str  # "connector" (our side-channel stats), "metrics" (our kvc:* on /metrics) or "builtin" (vllm:nixl_*)
    notes: tuple[str, ...] = ()
    proxy_args: tuple[str, ...] = ()  # flags of the proxy in front of this pair


def _ours(
    form: Mapping[str, str],
    p_extra: Mapping[str, Any],
    d_extra: Mapping[str, Any],
    settings: ServerSettings,
    source_tree: str | None = None,
) -> tuple[VllmServer, VllmServer]:
    kw: dict[str, Any] = {}
    if source_tree:  # another checkout of kv-connectors (e.g. the previous release) imported first:
        # `python -m` puts the working directory before PYTHONPATH, so the servers run in that checkout
        kw["extra_env"] = {"PYTHONPATH": source_tree}
        kw["cwd"] = source_tree
    p = pd_server(settings.model, "kv_producer", form=form, name="P", extra_config=p_extra, **kw, **settings.server_kwargs("P"))
    d = pd_server(settings.model, "kv_consumer", form=form, name="D", extra_config=d_extra, **kw, **settings.server_kwargs("D"))
    return p, d


def _baseline_tree() -> str:
    tree = os.environ.get(BASELINE_TREE_ENV, "")
    if not tree or not (Path(tree) / "kv_connectors").is_dir():
        raise ValueError(f"ours-nixl-pull-baseline needs ${BASELINE_TREE_ENV} set to a kv-connectors checkout")
    return tree


def builtin_transfer_config(role: str) -> str:
    """vLLM's own NixlConnector, KV in host memory (kv_buffer_device cpu)."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})


def builtin_server(settings: ServerSettings, role: str, name: str, progress_delay_us: int | None = None) -> VllmServer:
    """A server with vLLM's built-in NixlConnector; its side channel port comes from the environment.

    With progress_delay_us the server runs through builtin_launcher.py, which sets NIXL's
    progress-thread poll delay in the API server and in the engine core it spawns.
    """
    side_channel_port = free_port()
    env = {**UCX_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    server = VllmServer(
        settings.model,
        extra_args=["--kv-transfer-config", builtin_transfer_config(role)],
        extra_env=env,
        name=name,
        **settings.server_kwargs("P" if role == "kv_producer" else "D"),
    )
    if progress_delay_us is not None:
        module_at = server.argv.index("-m")
        server.argv[module_at : module_at + 2] = [str(BUILTIN_LAUNCHER)]
        if server.env is not None:
            server.env[PROGRESS_DELAY_ENV] = str(progress_delay_us)
    server.side_channel_port = side_channel_port  # type: ignore[attr-defined]
    return server


def _builtin(settings: ServerSettings, progress_delay_us: int | None = None) -> tuple[VllmServer, VllmServer]:
    return (
        builtin_server(settings, "kv_producer", "P", progress_delay_us),
        builtin_server(settings, "kv_consumer", "D", progress_delay_us),
    )


PATCHED_DELAY_US = 1000

CONFIGS: dict[str, PdConfig] = {
    c.name: c
    for c in (
        PdConfig(
            "ours-nixl-pull",
            "our NixlConnector (module path), D reads P's blocks",
            lambda s: _ours(MODULE_FORM, {}, {"mode": "pull"}, s),
            "connector",
        ),
        PdConfig(
            "ours-nixl-pull-baseline",
            f"our NixlConnector, pull, from the checkout named by ${BASELINE_TREE_ENV} (before/after in one run)",
            lambda s: _ours(MODULE_FORM, {}, {"mode": "pull"}, s, _baseline_tree()),
            "metrics",
        ),
        PdConfig(
            "ours-nixl-pull-unseeded-baseline",
            f"our NixlConnector, pull, from the checkout named by ${BASELINE_TREE_ENV}, the proxy without first token from prefill",
            lambda s: _ours(MODULE_FORM, {}, {"mode": "pull"}, s, _baseline_tree()),
            "metrics",
            proxy_args=("--no-first-token-from-prefill",),
        ),
        PdConfig(
            "ours-nixl-pull-unseeded",
            "our NixlConnector, pull, the proxy without first token from prefill (D generates every token)",
            lambda s: _ours(MODULE_FORM, {}, {"mode": "pull"}, s),
            "connector",
            proxy_args=("--no-first-token-from-prefill",),
        ),
        PdConfig(
            "ours-nixl-pull-cpus-builtin",
            "our NixlConnector, pull, engine_cpus builtin: P's and D's engine threads pinned as the built-in pins its own on CPU",
            lambda s: _ours(MODULE_FORM, {"engine_cpus": "builtin"}, {"mode": "pull", "engine_cpus": "builtin"}, s),
            "connector",
        ),
        PdConfig(
            "ours-nixl-pull-unseeded-cpus-builtin",
            "our NixlConnector, pull, engine_cpus builtin, the proxy without first token from prefill",
            lambda s: _ours(MODULE_FORM, {"engine_cpus": "builtin"}, {"mode": "pull", "engine_cpus": "builtin"}, s),
            "connector",
            proxy_args=("--no-first-token-from-prefill",),
        ),
        PdConfig(
            "ours-nixl-pull-spinning",
            "our NixlConnector, pull, with idle_wait_ms 0: vLLM's empty steps back to back, as without our pacing",
            lambda s: _ours(MODULE_FORM, {"idle_wait_ms": 0}, {"mode": "pull", "idle_wait_ms": 0}, s),
            "connector",
        ),
        PdConfig(
            "ours-nixl-push",
            "our NixlConnector, P writes into D's blocks",
            lambda s: _ours(MODULE_FORM, {}, {"mode": "push"}, s),
            "connector",
        ),
        PdConfig(
            "ours-mooncake", "our MooncakeConnector (tcp), push", lambda s: _ours(MOONCAKE_MODULE_FORM, {}, {}, s), "connector"
        ),
        PdConfig(
            "ours-nixl-staging",
            "our NixlConnector, pull through a host staging pool of 1/8 of the KV cache",
            lambda s: _ours(MODULE_FORM, s.staging, s.staging, s),
            "connector",
        ),
        PdConfig(BUILTIN, "vLLM's built-in NixlConnector, kv_buffer_device cpu, as shipped", _builtin, "builtin", (BUILTIN_NOTE,)),
        PdConfig(
            "builtin-nixl-patched",
            f"vLLM's built-in NixlConnector, NIXL progress delay {PATCHED_DELAY_US} us (launcher patch)",
            lambda s: _builtin(s, PATCHED_DELAY_US),
            "builtin",
            (PATCHED_NOTE.format(delay_us=PATCHED_DELAY_US),),
        ),
    )
}
# --configs default: every configuration as users would run it (the patched built-in is opt-in).
DEFAULT_CONFIGS = ("ours-nixl-pull", "ours-nixl-push", "ours-mooncake", "ours-nixl-staging", BUILTIN)


def parse_configs(text: str) -> list[str]:
    """Comma-separated configuration names, checked; duplicates dropped, order kept."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    if not names:
        raise ValueError("no configuration given")
    return list(dict.fromkeys(names))


def colocated_server(settings: ServerSettings) -> VllmServer:
    return VllmServer(settings.model, name=COLOCATED, **settings.server_kwargs())
