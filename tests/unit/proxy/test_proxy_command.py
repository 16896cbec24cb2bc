"""The proxy's three entry points agree: the installed command, `python -m kv_connectors.proxy`, and
the checkout's examples/proxy.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvc_testing.cluster import PROXY_SCRIPT, proxy_command

ROOT = Path(__file__).resolve().parents[3]


def _help(argv: list[str]) -> str:
    proc = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_installed_command_module_and_script_take_the_same_flags():
    installed = _help(proxy_command())
    assert "--prefill" in installed and "--decode" in installed and "--flow" in installed
    assert installed.startswith("usage: kv-connectors-proxy ")
    assert _help([sys.executable, "-m", "kv_connectors.proxy"]) == installed
    assert _help([sys.executable, str(PROXY_SCRIPT)]) == installed
