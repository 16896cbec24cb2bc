"""A real P holding a prompt's blocks for a D that has not come yet: vLLM runs empty engine steps
back to back the whole time (it must, for the connector to learn when D is done), and our connector
waits between them (kv_connectors.idle) instead of letting the engine spin a core.

Counted, not timed: the connector counts every empty step it sees (kvc:idle_steps). With each such
step waiting up to idle_wait_ms, a hold of H seconds allows at most about H / idle_wait_ms steps
(a loaded machine only makes fewer); with idle_wait_ms 0 the same hold runs vLLM's own pace.
"""

from __future__ import annotations

import time

from kvc_testing.cluster import make_prompts, pd_server, prefill, stats, wait_until
from kvc_testing.procs import VllmServer, running
from tests.e2e.conftest import MAX_MODEL_LEN

HOLD_S = 2.0
WAIT_MS = 20.0
PROMPT = make_prompts([150], seed=21)[0]


def _idle_p(tiny_model, idle_wait_ms: float) -> VllmServer:
    extra = {"idle_wait_ms": idle_wait_ms, "lease_s": HOLD_S + 1.5}
    return pd_server(tiny_model, "kv_producer", name=f"P-idle-{idle_wait_ms:g}", max_model_len=MAX_MODEL_LEN, extra_config=extra)


def _steps_while_holding(p: VllmServer) -> int:
    """Empty steps a P runs in HOLD_S seconds of holding a prompt's blocks; then the lease frees them."""
    prefill(p.url, PROMPT)
    s0 = stats(p)
    assert s0.held_blocks > 0, "P does not hold the prompt's blocks"
    time.sleep(HOLD_S)
    s1 = stats(p)
    assert s1.held_blocks == s0.held_blocks, "P let the blocks go before its lease ended"
    wait_until(lambda: stats(p).held_blocks == 0, 30, "P to free the blocks at its lease")
    return s1.idle_steps - s0.idle_steps


def test_p_holding_blocks_waits_between_empty_steps_instead_of_spinning(tiny_model):
    # Both P's start together; one holds blocks at a time (an idle P holding nothing runs no steps).
    with running(_idle_p(tiny_model, WAIT_MS), _idle_p(tiny_model, 0)) as (paced_p, spinning_p):
        paced = _steps_while_holding(paced_p)
        spinning = _steps_while_holding(spinning_p)
    # The backoff reaches the cap within ~2 x WAIT_MS; after that at most one step per WAIT_MS.
    bound = HOLD_S / (WAIT_MS / 1000) * 1.25 + 20
    assert 10 <= paced <= bound, f"{paced} empty steps in {HOLD_S} s of holding (at most {bound:.0f} expected)"
    assert spinning >= 5 * paced, f"without waits vLLM ran only {spinning} empty steps (paced: {paced})"
