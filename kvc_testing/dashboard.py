"""The example Grafana dashboard (examples/grafana/kv-connectors.json) and the metric samples it queries."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "kv-connectors.json"
# Sample names in PromQL: ours (kvc:*, kvc_proxy_*) and vLLM's (vllm:*); label names and functions
# are lower-case words without a colon or our prefixes, so they do not match.
_SAMPLE = re.compile(r"\b((?:kvc|vllm):[a-z_]+|kvc_proxy_[a-z_]+)\b")


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def sample_names(dashboard: dict[str, Any]) -> set[str]:
    """Every metric sample name a panel queries (e.g. kvc:recv_bytes_total, kvc:load_read_seconds_bucket)."""
    return {m for e in exprs(dashboard) for m in _SAMPLE.findall(e)}


def exported(metrics_text: str) -> set[str]:
    """Sample names in a /metrics page."""
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in metrics_text.splitlines() if line and not line.startswith("#")}
