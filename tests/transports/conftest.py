"""Fixtures shared by the transport tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvc_testing import peers


@pytest.fixture(scope="module")
def loopback_env() -> Iterator[None]:
    """UCX_NET_DEVICES=lo for the module's NIXL agents and the peers it spawns."""
    with peers.loopback_env():
        yield
