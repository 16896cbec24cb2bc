"""CPU staging (bounded host pool, chunked and pipelined) with real vLLM servers, NIXL pull and Mooncake push."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvc_testing.cluster import (
    ENTRY_POINT_FORM,
    MODULE_FORM,
    MOONCAKE_ENTRY_POINT_FORM,
    MOONCAKE_MODULE_FORM,
    ProxyProcess,
    pd_server,
    stats,
)
from kvc_testing.procs import running
from tests.e2e.checks import assert_pd_matches_colocated
from tests.e2e.conftest import MAX_MODEL_LEN

# The longest prompt's KV (max(LENGTHS) tokens, 32 per block, 32 KiB a block: 512 KiB) is four
# times the pool, so chunking runs.
STAGING = {"staging": "on", "staging_pool_kib": 128, "staging_chunk_kib": 32}
# The KV registered directly too: a block is 16 KiB in each of the 2 regions (one per layer), so a
# load of up to 5 blocks in a row, 2 runs of up to 80 KiB, goes through the pool, a longer one directly.
FRAGMENTED = {**STAGING, "staging": "fragmented", "staging_fragment_runs": 2, "staging_fragment_kib": 96}

SETUPS = {
    "nixl-pull": (MODULE_FORM, ENTRY_POINT_FORM, {"mode": "pull"}, STAGING),
    "mooncake-push": (MOONCAKE_MODULE_FORM, MOONCAKE_ENTRY_POINT_FORM, {"mode": "push"}, STAGING),
    "nixl-pull-fragmented": (MODULE_FORM, ENTRY_POINT_FORM, {"mode": "pull"}, FRAGMENTED),
    "mooncake-push-fragmented": (MOONCAKE_MODULE_FORM, MOONCAKE_ENTRY_POINT_FORM, {"mode": "push"}, FRAGMENTED),
}


@pytest.fixture(scope="module", params=sorted(SETUPS))
def staged_pair(request, tiny_model) -> Iterator[tuple]:
    p_form, d_form, d_extra, staging = SETUPS[request.param]
    p = pd_server(
        tiny_model, "kv_producer", form=p_form, name=f"P-staged-{request.param}", max_model_len=MAX_MODEL_LEN, extra_config=staging
    )
    d = pd_server(
        tiny_model,
        "kv_consumer",
        form=d_form,
        name=f"D-staged-{request.param}",
        max_model_len=MAX_MODEL_LEN,
        extra_config={**staging, **d_extra, "transfer_timeout_s": 20},
    )
    with running(p, d), ProxyProcess([p.url], [d.url]) as proxy:
        proxy.wait_ready()
        yield p, d, proxy, staging


def test_staged_greedy_equals_colocated_within_pool_bound(reference, staged_pair):
    p, d, proxy, staging = staged_pair
    assert_pd_matches_colocated(reference, p, d, proxy)
    bound = staging["staging_pool_kib"] * 1024
    both = [stats(server) for server in (p, d)]
    for s in both:
        assert s.staging_pool_bytes == bound, "staging is not on"
        assert s.staging_allocated_bytes == bound, "the pool grew beyond its configured size"
        assert 0 < s.staging_peak_bytes <= bound
    staged, direct = sum(s.staged_transfers for s in both), sum(s.direct_transfers for s in both)
    if staging["staging"] == "on":
        assert staged > 0 and direct == 0, (staged, direct)
    else:  # short prompts through the pool, long ones directly
        assert staged > 0 and direct > 0, (staged, direct)
