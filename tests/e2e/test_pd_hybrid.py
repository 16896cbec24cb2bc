"""Hybrid models with real vLLM servers: a tiny Gemma 3 (sliding window and global layers alternating) and
a tiny gpt-oss (sliding and full layers, attention sinks, experts), two KV cache groups each. Through the
proxy, D's greedy output equals a colocated server's with every prompt loaded from P (vLLM counts the
prompt tokens it took from the transfer), also with P pushing: over Mooncake in the transfer-id flow
(gpt-oss) and over NIXL through CPU staging (Gemma 3); a prompt longer than the window moves only the
window's blocks of its sliding layers; a Gemma 3 prefill with perturbed K/V weights changes D's output
(the KV travelled)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvc_testing.cluster import (
    MODULE_FORM,
    MOONCAKE_MODULE_FORM,
    ProxyProcess,
    generate,
    labelled,
    make_prompts,
    output_ids,
    pd_server,
    stats,
    wait_until,
)
from kvc_testing.hybrid_model import SLIDING_WINDOW, build_hybrid_model
from kvc_testing.procs import VllmServer, running
from kvc_testing.tiny_model import perturb_kv_weights
from tests.e2e.checks import BLOCK_SIZE, MAX_TOKENS, assert_foreign_kv_changes_output, assert_pd_matches_colocated
from tests.e2e.conftest import MAX_MODEL_LEN

EXTERNAL = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
# Around block boundaries and the sliding window (64 tokens), up to near max_model_len.
LENGTHS = [1, 31, 33, 63, 64, 65, 96, 129, 200, 320, 480, MAX_MODEL_LEN - MAX_TOKENS]
PAGE_BYTES = 2 * BLOCK_SIZE * 2 * 32 * 4  # one layer's block: 2 KV heads x 32 tokens x (K and V of 32) x fp32
LAYERS = 4  # the tiny hybrids': sliding, full, sliding, full

pytestmark = pytest.mark.timeout(900)


@dataclass
class Hybrid:
    family: str
    model: Path
    reference: VllmServer
    prefill: VllmServer
    decode: VllmServer
    proxy: ProxyProcess


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def hybrid(request: pytest.FixtureRequest) -> Iterator[Hybrid]:
    """One family's colocated server, P and D (NIXL, D pulling) and the proxy; the next family's once
    this one's tests are done (one set of servers at a time)."""
    family = request.param
    model = build_hybrid_model(family)
    servers = [
        VllmServer(model, max_model_len=MAX_MODEL_LEN, name=f"colocated-{family}"),
        pd_server(model, "kv_producer", form=MODULE_FORM, name=f"P-{family}", max_model_len=MAX_MODEL_LEN),
        pd_server(model, "kv_consumer", form=MODULE_FORM, name=f"D-{family}", max_model_len=MAX_MODEL_LEN),
    ]
    with running(*servers), ProxyProcess([servers[1].url], [servers[2].url]) as proxy:
        proxy.wait_ready()
        yield Hybrid(family, model, *servers, proxy)


def _pair_matches_colocated(
    reference: VllmServer, prefill: VllmServer, decode: VllmServer, seed: int, transfer_id: bool = False
) -> None:
    """Another P and D of the family (another transport, mode or staging), both ready, through their own
    proxy; `transfer_id`: the proxy sends P and D the request at once (P's side channel named to it).
    The proxy starts only now: one up before its P evicts it at its first health checks and, /health
    answering through D alone, lets D compute the first prompts itself (right answers, nothing loaded)."""
    side_channels = [prefill.side_channel_port] if transfer_id else None  # type: ignore[attr-defined]
    with ProxyProcess([prefill.url], [decode.url], prefill_side_channels=side_channels) as proxy:
        proxy.wait_ready()
        prompts = make_prompts([33, 65, 200, 480], seed=seed)
        loaded0 = stats(decode).recv_transfers
        want = [output_ids(generate(reference.url, p, MAX_TOKENS)) for p in prompts]
        got = [output_ids(generate(proxy.url, p, MAX_TOKENS)) for p in prompts]
        assert got == want
        assert stats(decode).recv_transfers - loaded0 == len(prompts) and stats(decode).recv_failures == 0
        wait_until(lambda: stats(prefill).held_blocks == 0, 10, "P to free the blocks")


def test_hybrid_pd_equals_colocated_with_every_prompt_loaded(hybrid: Hybrid) -> None:
    prompts = make_prompts(LENGTHS, seed=41)
    external0 = labelled(hybrid.decode.url, *EXTERNAL)
    sent = assert_pd_matches_colocated(hybrid.reference, hybrid.prefill, hybrid.decode, hybrid.proxy, prompts=prompts)
    # vLLM's own count of the prompt tokens D took from the transfer (it computes the last one itself).
    external = labelled(hybrid.decode.url, *EXTERNAL) - external0
    assert external >= sum(len(p) - 1 for p in prompts), (external, sent)


def test_a_prompt_longer_than_the_window_moves_only_the_windows_blocks_of_its_sliding_layers(hybrid: Hybrid) -> None:
    prompt = make_prompts([480], seed=43)[0]
    d0 = stats(hybrid.decode)
    assert output_ids(generate(hybrid.proxy.url, prompt, MAX_TOKENS)) == output_ids(
        generate(hybrid.reference.url, prompt, MAX_TOKENS)
    )
    d1 = stats(hybrid.decode)
    blocks = -(-len(prompt) // BLOCK_SIZE)
    full_attention = LAYERS * blocks * PAGE_BYTES  # every layer's every block: the model without windows
    moved = d1.recv_bytes - d0.recv_bytes
    window_blocks = -(-SLIDING_WINDOW // BLOCK_SIZE) + 1
    assert moved <= (LAYERS // 2) * (blocks + window_blocks) * PAGE_BYTES, moved
    assert moved < 0.7 * full_attention
    print(f"\n{hybrid.family}: a {len(prompt)}-token prompt moved {moved} bytes, {moved / full_attention:.2f} of full attention's")


def test_hybrid_pushed_over_mooncake_and_nixl_through_staging_and_with_foreign_kv(hybrid: Hybrid) -> None:
    """gpt-oss: Mooncake, P pushing (its default) in the transfer-id flow (the proxy sends P and D the
    request at once; P pairs its blocks with D's group by group). Gemma 3: NIXL with D asking P to push,
    through CPU staging; and a prefill with perturbed K/V weights (same compatibility hash) changes D's
    output: the KV travelled."""
    if hybrid.family == "gpt_oss":
        form, extra, name, transfer_id = MOONCAKE_MODULE_FORM, {}, "mooncake-push", True
        perturbed = None
    else:
        form, extra, name, transfer_id = MODULE_FORM, {"mode": "push", "staging": "on"}, "staged-push", False
        perturbed = pd_server(perturb_kv_weights(hybrid.model), "kv_producer", name="P-perturbed", max_model_len=MAX_MODEL_LEN)
    p = pd_server(hybrid.model, "kv_producer", form=form, name=f"P-{name}", max_model_len=MAX_MODEL_LEN, extra_config=extra)
    d = pd_server(hybrid.model, "kv_consumer", form=form, name=f"D-{name}", max_model_len=MAX_MODEL_LEN, extra_config=extra)
    with running(p, d, *([perturbed] if perturbed else [])):
        if perturbed:
            assert_foreign_kv_changes_output(hybrid.reference, perturbed, hybrid.decode)
        _pair_matches_colocated(hybrid.reference, p, d, seed=47, transfer_id=transfer_id)
        assert stats(p).pushes == 4, "P did not write every prompt"  # a fresh P
