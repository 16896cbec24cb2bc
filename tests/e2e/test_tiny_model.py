"""End-to-end checks of the tiny test model and the process helpers against real vLLM servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvc_testing.procs import (
    ManagedProcess,
    VllmServer,
    completion,
    free_port,
    free_ports,
    restart_busy,
)
from kvc_testing.tiny_model import (
    MARKER_FILE,
    build_tiny_model,
    perturb_kv_weights,
)

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 16
PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Prefill and decode run on two different servers",
    "Once upon a time in a small village by the river",
    "1 2 3 4 5 6 7 8",
]
# Same last words, different beginnings: the continuation must depend on earlier KV, or a
# broken KV transfer (zeros, wrong blocks) would go unnoticed.
SHARED_SUFFIX = " and the city sleeps under the warm summer night"
PREFIXES = ["A river runs to the ocean", "Monday morning the server sends a letter"]


@dataclass
class Servers:
    model: Path
    perturbed_model: Path
    ref: VllmServer
    perturbed: VllmServer


@pytest.fixture
def servers(tiny_model: Path, perturbed_model: Path, reference: VllmServer, perturbed_prefill: VllmServer) -> Servers:
    """The session's colocated server on the tiny model and its P on the KV-perturbed copy (a P serves
    a plain completion as any server does)."""
    return Servers(tiny_model, perturbed_model, reference, perturbed_prefill)


def _greedy(url: str, prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    out = completion(url, prompt, max_tokens, ignore_eos=True)
    ids = out["choices"][0]["token_ids"]
    assert isinstance(ids, list) and len(ids) == max_tokens, out
    return ids


def test_greedy_is_deterministic_varied_and_not_repetitive(servers: Servers) -> None:
    first = [_greedy(servers.ref.url, p) for p in PROMPTS]
    second = [_greedy(servers.ref.url, p) for p in PROMPTS]
    assert first == second, "greedy output changed between two identical calls"
    assert len({tuple(ids) for ids in first}) == len(PROMPTS), f"prompts share output: {first}"
    for prompt, ids in zip(PROMPTS, first):
        assert len(set(ids)) >= 4, f"near-constant continuation for {prompt!r}: {ids}"


def test_continuation_depends_on_earlier_context(servers: Servers) -> None:
    outs = [_greedy(servers.ref.url, prefix + SHARED_SUFFIX) for prefix in PREFIXES]
    assert outs[0] != outs[1], "output depends only on the last tokens: KV would be untested"


def test_token_id_prompt_matches_text_prompt(servers: Servers) -> None:
    text = completion(servers.ref.url, PROMPTS[0], MAX_TOKENS, ignore_eos=True)
    prompt_ids = text["choices"][0]["prompt_token_ids"]
    assert prompt_ids and prompt_ids[0] == 1, "tokenizer should prepend <s> (id 1)"
    assert _greedy(servers.ref.url, prompt_ids) == text["choices"][0]["token_ids"]


def test_chat_completions_uses_chat_template(servers: Servers) -> None:
    (served,) = httpx.get(f"{servers.ref.url}/v1/models", timeout=10).json()["data"]
    resp = httpx.post(
        f"{servers.ref.url}/v1/chat/completions",
        json={
            "model": served["id"],
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] >= 1
    assert isinstance(body["choices"][0]["message"]["content"], str)


def test_perturbed_kv_weights_change_output_but_not_config(servers: Servers) -> None:
    src, pert = servers.model, servers.perturbed_model
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (src / name).read_bytes() == (pert / name).read_bytes(), name
    assert (src / "model.safetensors").read_bytes() != (pert / "model.safetensors").read_bytes()
    for prompt in PROMPTS[:2]:
        assert _greedy(servers.ref.url, prompt) != _greedy(servers.perturbed.url, prompt)
    assert perturb_kv_weights(src) == pert, "second call must reuse the cached copy"


def test_build_is_deterministic_cached_and_concurrency_safe(tmp_path: Path) -> None:
    # Two processes build into the same empty cache at once; a third builds elsewhere.
    code = "import sys; from kvc_testing.tiny_model import build_tiny_model; print(build_tiny_model(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    dirs = [tmp_path / "shared", tmp_path / "shared", tmp_path / "other"]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(d)], stdout=subprocess.PIPE, env=env) for d in dirs]
    outs = [p.communicate(timeout=300)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outs[0] == outs[1]
    digests = [json.loads((Path(o) / MARKER_FILE).read_text())["digest"] for o in outs]
    assert len(set(digests)) == 1, "same seed must give byte-identical model and tokenizer"
    assert sorted(p.name for p in (tmp_path / "shared").iterdir() if not p.name.startswith(".")) == [Path(outs[0]).name], (
        "temp build dirs were left behind"
    )
    t0 = time.monotonic()
    assert build_tiny_model(tmp_path / "shared") == Path(outs[0])
    assert time.monotonic() - t0 < 1.0, "cached model was rebuilt"


def test_free_ports_are_distinct() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(1024 <= p < 65536 for p in ports)
    assert isinstance(free_port(), int)


def test_wait_ready_reports_death_and_deadline(tmp_path: Path) -> None:
    dead = VllmServer("unused", log_path=tmp_path / "dead.log")
    dead.argv = [sys.executable, "-c", "print('boom-marker'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)code 3.*boom-marker"):
        with dead:
            pass
    slow = VllmServer("unused", log_path=tmp_path / "slow.log")
    slow.argv = [sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(60)"]
    slow.start()
    try:
        with pytest.raises(RuntimeError, match=r"(?s)not ready after.*sleeping"):
            slow.wait_ready(timeout=2)
    finally:
        slow.stop()
    assert not slow.group_alive()


def test_stop_escalates_to_sigkill_for_the_whole_group(tmp_path: Path) -> None:
    # bash and its background child both ignore SIGTERM (ignored dispositions survive exec).
    script = "trap '' TERM; sleep 300 & sleep 300 & wait"
    proc = ManagedProcess(["bash", "-c", script], name="stubborn", log_path=tmp_path / "s.log")
    proc.start()
    deadline = time.monotonic() + 10
    while len(proc.group_pids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(proc.group_pids()) >= 3
    pgid = proc.pgid
    assert pgid is not None
    t0 = time.monotonic()
    rc = proc.stop(timeout=1.0)
    assert rc == -signal.SIGKILL
    assert time.monotonic() - t0 < 15
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_restart_busy_restarts_only_the_group_that_burns_cpu(tmp_path: Path) -> None:
    busy = ManagedProcess([sys.executable, "-c", "while True: pass"], name="busy", log_path=tmp_path / "b.log")
    idle = ManagedProcess(["sleep", "300"], name="idle", log_path=tmp_path / "i.log")
    with busy, idle:
        busy_pid, idle_pid = busy.pid, idle.pid
        restarted = restart_busy([busy, idle], limit_cores=0.3, window_s=1.0)
        assert [p.name for p, _ in restarted] == ["busy"], restarted
        assert restarted[0][1] > 0.3
        assert busy.is_running() and busy.pid != busy_pid, "the busy group was not started again"
        assert idle.pid == idle_pid and idle.is_running()
        with pytest.raises(ProcessLookupError):
            os.kill(busy_pid, 0)


def test_server_env_drops_legacy_kv_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    # VLLM_CPU_KVCACHE_SPACE (GiB) would silently override --kv-cache-memory-bytes.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    srv = VllmServer("m", cpu_bind=1, kv_cache_bytes=32 << 20, port=free_port())
    assert srv.env is not None and "VLLM_CPU_KVCACHE_SPACE" not in srv.env
    assert srv.env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and "OMP_PLACES" not in srv.env
    assert srv.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and srv.env["OMP_NUM_THREADS"] == "1"
    assert srv.argv[srv.argv.index("--kv-cache-memory-bytes") + 1] == str(32 << 20)
    pinned = VllmServer("m", cpu_bind=0, pin=True)
    assert pinned.env is not None and pinned.env["OMP_PLACES"] == "{0}"


def test_stop_leaves_no_vllm_process_behind(servers: Servers) -> None:
    # It stops the session's perturbed P: the next test asking for it starts it again.
    srv = servers.perturbed
    pgid = srv.pgid
    assert pgid is not None and srv.is_running()
    assert len(srv.group_pids()) >= 2, "expected API server + EngineCore in the group"
    srv.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    assert not srv.is_running()
