"""The unit tests' async tests (pytest.mark.anyio) run on asyncio, the proxy's loop (trio is not installed)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
