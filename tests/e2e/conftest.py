"""Real vLLM servers for end-to-end tests: a colocated reference, P (module-path form), D (entry-point form), proxy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvc_testing.cluster import ENTRY_POINT_FORM, MODULE_FORM, ProxyProcess, pd_server
from kvc_testing.procs import VllmServer
from kvc_testing.tiny_model import build_tiny_model, perturb_kv_weights

MAX_MODEL_LEN = 512


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny_model()


@pytest.fixture(scope="session")
def perturbed_model(tiny_model: Path) -> Path:
    return perturb_kv_weights(tiny_model)


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> Iterator[VllmServer]:
    with VllmServer(tiny_model, max_model_len=MAX_MODEL_LEN, name="colocated") as server:
        yield server


@pytest.fixture(scope="session")
def prefill_server(tiny_model: Path) -> Iterator[VllmServer]:
    server = pd_server(tiny_model, "kv_producer", form=MODULE_FORM, name="P", max_model_len=MAX_MODEL_LEN)
    with server:
        yield server


@pytest.fixture(scope="session")
def decode_server(tiny_model: Path) -> Iterator[VllmServer]:
    server = pd_server(
        tiny_model,
        "kv_consumer",
        form=ENTRY_POINT_FORM,
        name="D",
        max_model_len=MAX_MODEL_LEN,
        extra_config={"handshake_timeout_s": 5, "transfer_timeout_s": 10},
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def proxy(prefill_server: VllmServer, decode_server: VllmServer) -> Iterator[ProxyProcess]:
    with ProxyProcess([prefill_server.url], [decode_server.url]) as p:
        p.wait_ready()
        yield p
