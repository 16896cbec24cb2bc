"""Suite-wide guard: every child process group a test started is gone when the session ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvc_testing.procs import started_processes


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    yield  # torn down after every other session fixture (servers, proxies)
    leftovers = [p for p in started_processes() if p.group_alive()]
    for p in leftovers:
        p.stop(timeout=5)
    assert not leftovers, f"process groups left running: {leftovers}"
