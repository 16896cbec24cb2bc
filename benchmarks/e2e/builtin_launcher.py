"""Run vLLM's OpenAI server with NIXL's progress-thread poll delay set (bench_e2e.py's builtin-nixl-patched).

nixl_agent (nixl 1.5.1) hard-codes pthrDelay = 0 on the agent config it builds, so its progress
thread spins a core. This launcher wraps the bindings' agent constructor to set the delay, then runs
vLLM's api_server module; vLLM's files are untouched.

The delay comes from the environment (PROGRESS_DELAY_ENV) and the patch is applied at import:
vLLM's CPU platform starts its engine core with multiprocessing's spawn, and a spawned child
imports its parent's main script (this file, as __mp_main__) before it runs the engine, so the
engine core, where the NIXL agent lives, is patched too.

usage: PROGRESS_DELAY_ENV=N builtin_launcher.py [vLLM api_server arguments...]
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from typing import Any

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PROGRESS_DELAY_ENV = "KVC_BENCH_NIXL_PROGRESS_DELAY_US"


def patch_nixl(progress_delay_us: int) -> None:
    """Every NIXL agent created in this process polls every progress_delay_us (logged once per agent)."""
    # vLLM sets this before its own first nixl import; nixl is imported here first, so set it the same way.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    api = importlib.import_module("nixl._api")
    bind = getattr(api, "nixlBind", None) or importlib.import_module("nixl._bindings")
    real_agent_cls = bind.nixlAgent

    def make_agent(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = progress_delay_us
        print(f"[builtin_launcher] pid {os.getpid()} NIXL agent {agent_name}: pthrDelay={progress_delay_us} us", flush=True)
        return real_agent_cls(agent_name, agent_config)

    bind.nixlAgent = make_agent


def _delay_from_env() -> int:
    text = os.environ.get(PROGRESS_DELAY_ENV, "")
    if not text.isdigit():
        raise SystemExit(f"builtin_launcher: set {PROGRESS_DELAY_ENV} to the delay in microseconds (got {text!r})")
    return int(text)


patch_nixl(_delay_from_env())  # here and in every spawned child (see the module docstring)

if __name__ == "__main__":
    sys.argv = [SERVER_MODULE, *sys.argv[1:]]
    # alter_sys=False keeps this file as __main__, which spawned children re-import.
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=False)
