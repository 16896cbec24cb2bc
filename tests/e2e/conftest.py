"""Real vLLM servers for end-to-end tests: a colocated reference, P (module-path form), D (entry-point form), proxy."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvc_testing.cluster import ENTRY_POINT_FORM, MODULE_FORM, MOONCAKE_MODULE_FORM, ProxyProcess, pd_server
from kvc_testing.procs import VllmServer, restart_busy, running
from kvc_testing.tiny_model import build_tiny_model, perturb_kv_weights

MAX_MODEL_LEN = 512
# The session D's deadlines for a P's answers (handshake) and for a transfer.
D_HANDSHAKE_S = 5
D_TRANSFER_S = 10


# The session's P and D, looked at between test modules. An idle NIXL server here has been seen to
# start burning one or two cores and keep on (its UCX progress thread spinning on a TCP socket
# that stays writable, trigger not yet reproduced alone): on this 2-core host that halves the
# speed of every later test and starves the TP tests' pinned cores. Such a server is restarted
# (same command line and ports; D and P treat it as a restarted peer), with a warning in the
# test summary so every occurrence is seen.
_LONG_LIVED: list[VllmServer] = []
_PROXIES: list[ProxyProcess] = []  # the session proxy, restarted after them (its health view starts afresh)
IDLE_WINDOW_S = 2.0
IDLE_CPU_LIMIT = 0.5  # cores; an idle P or D holding nothing uses a few percent


def _restart_spinning(servers: list[VllmServer], where: str) -> None:
    restarted = restart_busy(servers, IDLE_CPU_LIMIT, IDLE_WINDOW_S)
    for server, cores in restarted:
        warnings.warn(f"session server {server.name} used {cores:.2f} cores while idle after {where}: restarted", stacklevel=1)
        server.wait_ready()
    for proxy in _PROXIES if restarted else []:
        proxy.restart()
        proxy.wait_ready()


@pytest.fixture(scope="module", autouse=True)
def _long_lived_servers_stay_idle(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if _LONG_LIVED:
        _restart_spinning(_LONG_LIVED, request.module.__name__)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny_model()


@pytest.fixture(scope="session")
def perturbed_model(tiny_model: Path) -> Path:
    return perturb_kv_weights(tiny_model)


@pytest.fixture(scope="session")
def _session_servers(tiny_model: Path, perturbed_model: Path) -> Iterator[tuple[VllmServer, ...]]:
    """The colocated reference, P and D, a P over Mooncake (three modules write from it) and a P with
    perturbed K/V weights (three modules), started together (nearly every module needs the first three)."""
    reference = VllmServer(tiny_model, max_model_len=MAX_MODEL_LEN, name="colocated")
    prefill = pd_server(tiny_model, "kv_producer", form=MODULE_FORM, name="P", max_model_len=MAX_MODEL_LEN)
    decode = pd_server(
        tiny_model,
        "kv_consumer",
        form=ENTRY_POINT_FORM,
        name="D",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"handshake_timeout_s": D_HANDSHAKE_S, "transfer_timeout_s": D_TRANSFER_S},
    )
    mooncake = pd_server(tiny_model, "kv_producer", form=MOONCAKE_MODULE_FORM, name="P-mooncake", max_model_len=MAX_MODEL_LEN)
    perturbed = pd_server(perturbed_model, "kv_producer", form=MODULE_FORM, name="P-perturbed", max_model_len=MAX_MODEL_LEN)
    with running(reference, prefill, decode, mooncake, perturbed):
        _LONG_LIVED.extend([prefill, decode, mooncake, perturbed])
        yield reference, prefill, decode, mooncake, perturbed


@pytest.fixture(scope="session")
def reference(_session_servers: tuple[VllmServer, ...]) -> VllmServer:
    return _session_servers[0]


@pytest.fixture(scope="session")
def prefill_server(_session_servers: tuple[VllmServer, ...]) -> VllmServer:
    return _session_servers[1]


@pytest.fixture(scope="session")
def decode_server(_session_servers: tuple[VllmServer, ...]) -> VllmServer:
    return _session_servers[2]


@pytest.fixture(scope="session")
def mooncake_prefill(_session_servers: tuple[VllmServer, ...]) -> VllmServer:
    """P over Mooncake (module-path form, defaults): a D over Mooncake asks it to write."""
    return _session_servers[3]


@pytest.fixture
def perturbed_prefill(_session_servers: tuple[VllmServer, ...]) -> VllmServer:
    """P on the tiny model with perturbed K/V weights (the same compatibility hash as P's): a D that
    loads its KV answers otherwise than colocated, which proves the KV travelled. Started again if a
    test stopped it (test_tiny_model checks what stopping a server leaves behind)."""
    server = _session_servers[4]
    if not server.is_running():
        server.start()
        server.wait_ready()
    return server


@pytest.fixture(scope="session")
def proxy(prefill_server: VllmServer, decode_server: VllmServer) -> Iterator[ProxyProcess]:
    with ProxyProcess([prefill_server.url], [decode_server.url]) as p:
        p.wait_ready()
        _PROXIES.append(p)
        yield p
