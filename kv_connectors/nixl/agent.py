"""NIXL itself: its modules loaded on first use (UCX defaults set first), and agents whose progress thread does not spin."""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType
from typing import Any

from kv_connectors.errors import TransportUnavailableError
from kv_connectors.nixl import ucx

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install kv-connectors[nixl]"
# nixl_agent's constructor is patched for the duration of one creation (see create_agent).
_AGENT_CREATE_LOCK = threading.Lock()
_nixl: tuple[ModuleType, ModuleType] | None = None


def load_nixl() -> tuple[ModuleType, ModuleType]:
    """(nixl._api, its bindings module), imported on first use so `import kv_connectors` stays light."""
    global _nixl
    if _nixl is None:
        ucx.apply_defaults()
        try:
            api = importlib.import_module("nixl._api")
        except (ImportError, OSError) as e:
            raise TransportUnavailableError(
                f"the NIXL transport needs the nixl package ({e}); install it with: {_INSTALL_HINT}"
            ) from e
        bind = getattr(api, "nixlBind", None) or importlib.import_module("nixl._bindings")
        _nixl = (api, bind)
    return _nixl


def loaded_bindings() -> ModuleType | None:
    """NIXL's bindings module once load_nixl() ran, else None (its exception types map errors)."""
    return _nixl[1] if _nixl is not None else None


def create_agent(name: str, conf: Any, progress_delay_us: int) -> Any:
    """Create a nixl_agent whose progress thread sleeps progress_delay_us between polls.

    nixl_agent (1.5.1) builds the bindings' nixlAgentConfig itself and hard-codes pthrDelay = 0,
    so its progress thread spins a whole core forever. nixl_agent_config has no knob for it, so
    the bindings' nixlAgent constructor is wrapped for the duration of this one call to set the
    delay on the config it is handed (under a lock: the patch is process-wide while it lasts).
    """
    api, bindings = load_nixl()
    bind: Any = bindings  # its nixlAgent is replaced for the call below
    real_agent_cls = bind.nixlAgent
    applied: list[bool] = []

    def make_agent(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = progress_delay_us
        applied.append(True)
        return real_agent_cls(agent_name, agent_config)

    with _AGENT_CREATE_LOCK:
        bind.nixlAgent = make_agent
        try:
            agent = api.nixl_agent(name, conf)
        finally:
            bind.nixlAgent = real_agent_cls
    if not applied:
        logger.warning("could not set the NIXL progress-thread delay (nixl_agent changed); it may spin a core")
    return agent
