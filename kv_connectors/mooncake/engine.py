"""Mooncake itself: `mooncake.engine` imported on first use, a missing wheel or system library named."""

from __future__ import annotations

import importlib
from types import ModuleType

from kv_connectors.errors import TransportUnavailableError

_INSTALL_HINT = "pip install kv-connectors[mooncake]"
_APT_HINT = "apt-get install -y libibverbs1 libnl-3-200 libnl-route-3-200"
_mooncake: ModuleType | None = None


def load_mooncake() -> ModuleType:
    """mooncake.engine, imported on first use so `import kv_connectors` stays light."""
    global _mooncake
    if _mooncake is None:
        try:
            _mooncake = importlib.import_module("mooncake.engine")
        except (ImportError, OSError) as e:
            libs = any(lib in str(e) for lib in ("libibverbs", "libnl", "cannot open shared object"))
            hint = f"system libraries (even for TCP): {_APT_HINT}; and " if libs else ""
            raise TransportUnavailableError(
                f"the Mooncake transport cannot load mooncake.engine ({e}); install {hint}{_INSTALL_HINT}"
            ) from e
    return _mooncake
