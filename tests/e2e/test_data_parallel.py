"""Data parallelism served as vLLM's built-in serves it: a prefill instance with
`--data-parallel-size 2` runs two engines, each with its own engine id (vLLM adds `_dp<index>`) and
its own side channel (`side_channel_port + index`); P's answer names the engine that holds the
prompt's KV, so D reads from that one. Every answer through the proxy equals the colocated
server's, and both of P's engines hand KV to D.

P's engines run on core 0 and D on core 1: vLLM's workers spin between steps, and P's four
processes on shared cores starved D for tens of seconds (a first handshake or connect stalled until
P's lease ran out). The deadlines are long besides: this test checks where the KV comes from, not
how fast."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import pytest

from kvc_testing.cluster import (
    ENTRY_POINT_FORM,
    MODULE_FORM,
    ProxyProcess,
    generate,
    make_prompts,
    output_ids,
    pd_server,
    stats,
    wait_until,
)
from kvc_testing.procs import VllmServer, running
from tests.e2e.conftest import MAX_MODEL_LEN

MAX_TOKENS = 8
DP = 2
SLOW_HOST = ["--health-timeout-s", "20", "--unhealthy-after", "5", "--decode-timeout-s", "300", "--prefill-timeout-s", "300"]


@pytest.fixture(scope="module")
def dp_pair(tiny_model) -> Iterator[tuple[VllmServer, ...]]:
    """P at DP 2 on core 0, a patient D and a D at DP 2 on core 1, started together."""
    server = pd_server(
        tiny_model,
        "kv_producer",
        form=MODULE_FORM,
        name="P-dp2",
        max_model_len=MAX_MODEL_LEN,
        dp=DP,
        extra_config={"lease_s": 240},
        cpu_bind="0|0",
        ready_cpus="0",
    )
    with running(server, _patient_decode(tiny_model, "D-patient"), _patient_decode(tiny_model, "D-dp2", dp=DP)) as servers:
        yield servers


@pytest.fixture(scope="module")
def dp_prefill(dp_pair) -> VllmServer:
    return dp_pair[0]


def _patient_decode(tiny_model, name: str, dp: int = 1) -> VllmServer:
    """D on core 1 with long deadlines (this module checks where the KV comes from, not how fast)."""
    extra = {"handshake_timeout_s": 60, "transfer_timeout_s": 120}
    pinned = {"cpu_bind": "|".join(["1"] * dp)} if dp > 1 else {}
    return pd_server(
        tiny_model,
        "kv_consumer",
        form=ENTRY_POINT_FORM,
        name=name,
        max_model_len=MAX_MODEL_LEN,
        dp=dp,
        extra_config=extra,
        ready_cpus="1",
        **pinned,
    )


def _exact_through_proxy(reference, proxy: ProxyProcess, prompts: list[list[int]], concurrency: int = 1) -> None:
    """Every prompt through the proxy answers as the colocated server does."""
    want = [output_ids(generate(reference.url, p, MAX_TOKENS)) for p in prompts]
    proxy.wait_ready()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        got = list(pool.map(lambda p: output_ids(generate(proxy.url, p, MAX_TOKENS, timeout=300)), prompts))
    mismatches = [(len(p), w, g) for p, w, g in zip(prompts, want, got) if w != g]
    assert not mismatches, f"PD output differs from colocated (length, expected, got): {mismatches}"


def _loaded_and_sent(p: VllmServer, d: VllmServer, d0: Any, engines: list[Any], n: int) -> list[int]:
    """D loaded all n prompts (none failed) and P's engines freed them: how many each engine sent."""
    d1 = stats(d)
    assert d1.recv_transfers - d0.recv_transfers == n and d1.recv_failures == d0.recv_failures
    for e in range(DP):
        wait_until(lambda e=e: stats(p, dp=e).held_blocks == 0, 10, f"P engine {e} to free the blocks D read")
    return [stats(p, dp=e).completed_sends - engines[e].completed_sends for e in range(DP)]


@pytest.fixture(scope="module")
def patient_decode(dp_pair) -> VllmServer:
    return dp_pair[1]


def test_each_data_parallel_prefill_engine_hands_its_kv_to_decode(reference, dp_prefill, patient_decode) -> None:
    decode_server = patient_decode
    engines = [stats(dp_prefill, dp=d) for d in range(DP)]
    assert [e.engine_id.rsplit("_", 1)[-1] for e in engines] == ["dp0", "dp1"]  # one side channel each
    d0 = stats(decode_server)
    prompts = make_prompts([40, 70, 100, 130, 45, 75, 105, 135, 50, 80, 110, 140], seed=6061)
    with ProxyProcess([dp_prefill.url], [decode_server.url], extra_args=SLOW_HOST) as proxy:
        # Concurrent: P's API server spreads them over its engines (the least loaded first).
        _exact_through_proxy(reference, proxy, prompts, concurrency=4)
    sent = _loaded_and_sent(dp_prefill, decode_server, d0, engines, len(prompts))
    assert sum(sent) == len(prompts) and all(n > 0 for n in sent), f"sends per P engine: {sent}"


def test_transfer_id_flow_pins_each_prompt_to_the_engine_whose_side_channel_d_is_told(
    reference, dp_prefill, patient_decode
) -> None:
    """The transfer-id flow (P and D sent at once, D told P's side channel): the proxy, told P's
    engines (`PORT,dp=2`), sends each P request to one engine (vLLM's X-data-parallel-rank) and names
    that engine's side channel to D, in turn; every answer equals the colocated server's and both
    engines pushed KV to D. Without the pin, D asks engine 0 for KV that engine 1 may hold."""
    decode_server = patient_decode
    engines = [stats(dp_prefill, dp=d) for d in range(DP)]
    d0 = stats(decode_server)
    prompts = make_prompts([60, 90, 120, 150], seed=6062)
    side_channel = f"127.0.0.1:{dp_prefill.side_channel_port},dp={DP}"
    with ProxyProcess(
        [dp_prefill.url],
        [decode_server.url],
        prefill_side_channels=[side_channel],
        extra_args=["--flow", "transfer-id", *SLOW_HOST],
    ) as proxy:
        _exact_through_proxy(reference, proxy, prompts)
    sent = _loaded_and_sent(dp_prefill, decode_server, d0, engines, len(prompts))
    assert sent == [len(prompts) // DP] * DP, f"sends per P engine: {sent}"


@pytest.fixture(scope="module")
def dp_decode(dp_pair) -> VllmServer:
    return dp_pair[2]


def test_a_data_parallel_decode_loads_on_each_engine(reference, dp_prefill, dp_decode) -> None:
    """D at `--data-parallel-size 2` too: each of D's engines has its own side channel and agent, and
    whichever takes a request loads its KV from the P engine P's answer names; every answer equals the
    colocated server's and both D engines loaded KV."""
    loads0 = [stats(dp_decode, dp=d).recv_transfers for d in range(DP)]
    prompts = make_prompts([45, 75, 105, 135, 55, 85, 115, 145], seed=6063)
    with ProxyProcess([dp_prefill.url], [dp_decode.url], extra_args=SLOW_HOST) as proxy:
        _exact_through_proxy(reference, proxy, prompts, concurrency=4)
    engines = [stats(dp_decode, dp=d) for d in range(DP)]
    assert [e.engine_id.rsplit("_", 1)[-1] for e in engines] == ["dp0", "dp1"]
    loads = [e.recv_transfers - n for e, n in zip(engines, loads0)]
    assert sum(loads) == len(prompts) and all(n > 0 for n in loads), f"loads per D engine: {loads}"
    assert all(e.recv_failures == 0 for e in engines)
