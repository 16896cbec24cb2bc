"""Module attributes built on first access (keeps transport packages from importing vLLM eagerly)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def lazy_attribute(module_globals: dict[str, Any], name: str, build: Callable[[], Any]) -> Callable[[str], Any]:
    """A module-level __getattr__ that builds `name` once, caches it in the module and returns it."""

    def __getattr__(attr: str) -> Any:
        if attr != name:
            raise AttributeError(f"module {module_globals['__name__']!r} has no attribute {attr!r}")
        value = build()
        module_globals[name] = value
        return value

    return __getattr__
