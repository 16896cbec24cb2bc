"""PD disaggregation proxy for xPyD fleets: N prefill and M decode vLLM servers behind one OpenAI endpoint.

Reading order: config (flags) -> prefix (prompt keys, per-backend LRU) -> backends (state, policies, draining,
health checks) -> sse (vLLM's events) -> bodies (validation, P/D bodies, split/merge) -> upstream (one backend
call) -> tokens (prompt length) -> flows (params and transfer-id flows, D alone, retries) -> dispatch (one
client request) -> relay (SSE out) -> admin (fleet changes) -> app (routes).
"""

try:
    from .app import build_app, main
except ModuleNotFoundError as e:  # the proxy extra is not installed
    if e.name not in {"fastapi", "starlette", "uvicorn", "httpx", "prometheus_client"}:
        raise
    raise ModuleNotFoundError(f"the proxy needs `pip install 'kv-connectors[proxy]'` ({e})", name=e.name) from e
from .config import BackendSpec, ConfigError, Flow, Policy, ProxyConfig, Role, SideChannel
from .flags import parse_args

__all__ = ["BackendSpec", "ConfigError", "Flow", "Policy", "ProxyConfig", "Role", "SideChannel", "build_app", "main", "parse_args"]
