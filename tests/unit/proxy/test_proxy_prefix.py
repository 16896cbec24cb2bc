"""The prefix policy: prompt keys, the per-backend LRU, choosing by longest match unless load is imbalanced,
multi-turn conversations staying on their P and D, and D alone when it has cached all but a few tokens."""

from __future__ import annotations

import pytest

from kv_connectors.proxy.backends import BackendPool
from kv_connectors.proxy.config import BackendSpec, Policy, PrefixSettings, Role
from kv_connectors.proxy.flags import parse_args
from kv_connectors.proxy.metrics import ProxyMetrics
from kv_connectors.proxy.prefix import PrefixCache, prompt_key
from tests.unit.proxy.proxy_fakes import D1, D2, P1, P2, Fleet, config, metric_value, running

pytestmark = pytest.mark.anyio


def test_keys_chain_whole_chunks_only() -> None:
    a = prompt_key(list(range(40)), None, 16)
    b = prompt_key(list(range(32)) + [99] * 8, None, 16)
    c = prompt_key([7] + list(range(1, 40)), None, 16)
    assert len(a.hashes) == 2 and a.hashes == b.hashes  # the partial third chunk is left out
    assert c.hashes[0] != a.hashes[0] and c.hashes[1] != a.hashes[1]  # a chunk's hash covers every chunk before it
    text = prompt_key("x" * 130, None, 16)  # 64 characters a chunk
    assert len(text.hashes) == 2 and text.text and text.units == 130
    chat1 = prompt_key(None, [{"role": "user", "content": "hello " * 30}], 4)
    chat2 = prompt_key(None, [{"role": "user", "content": "hello " * 30}, {"role": "assistant", "content": "hi"}], 4)
    assert chat2.hashes[: len(chat1.hashes)] == chat1.hashes
    assert prompt_key(None, [{"role": "system", "content": "hello " * 30}], 4).hashes[0] != chat1.hashes[0]
    assert a.covered_fraction(1) == pytest.approx(16 / 40) and a.covered_fraction(0) == 0


def test_cache_is_an_lru_of_bounded_size() -> None:
    cache = PrefixCache(capacity=4)
    old = prompt_key(list(range(32)), None, 16)  # 2 chunks
    cache.insert(old)
    assert cache.match(old) == 2
    for i in range(2):
        cache.insert(prompt_key([100 + i] * 16, None, 16))
    assert len(cache) == 4 and cache.match(old) == 2  # matching refreshed it
    cache.insert(prompt_key([200] * 48, None, 16))  # 3 more chunks: the two least recent go
    assert len(cache) == 4 and cache.match(old) == 0
    assert cache.match(prompt_key([200] * 48, None, 16)) == 3


def _pool(urls: tuple[str, ...] = (D1, D2), **settings: float) -> BackendPool:
    return BackendPool(Role.DECODE, [BackendSpec(u) for u in urls], Policy.PREFIX, ProxyMetrics(), PrefixSettings(**settings))  # type: ignore[arg-type]


def test_longest_match_wins_unless_load_is_imbalanced() -> None:
    pool = _pool(balance_abs=2, balance_rel=1.5)
    d1, d2 = pool.backends
    conv_a, conv_b = [1] * 32, [2] * 32
    assert pool.pick(key=prompt_key(conv_a, None, 16)) is d1  # nobody has it: the idlest, by round robin
    d1.outstanding = 1
    assert pool.pick(key=prompt_key(conv_b, None, 16)) is d2  # a miss goes to the idlest
    d2.outstanding = 1
    for _ in range(3):
        assert pool.pick(key=prompt_key(conv_a + [5] * 20, None, 16)) is d1  # turn 2 of a: on d1
        assert pool.pick(key=prompt_key(conv_b + [6] * 20, None, 16)) is d2
    d1.outstanding, d2.outstanding = 5, 1  # 4 more in flight and 5x: load wins
    assert pool.pick(key=prompt_key(conv_a, None, 16)) is d2
    d1.outstanding = 3  # 2 more: within balance_abs, the longest match wins (d2 has a's first 2 chunks now)
    assert pool.pick(key=prompt_key(conv_a + [5] * 20, None, 16)) is d1
    assert pool.pick(exclude={d1}, key=prompt_key(conv_a, None, 16)) is d2  # a retry elsewhere
    assert pool.expected_match(prompt_key(conv_a + [5] * 32, None, 16)) == pytest.approx(48 / 64)
    text = pool.metrics.render().decode()
    assert metric_value(text, "kvc_proxy_prefix_decisions_total", role="decode", result="balance") == 1
    assert metric_value(text, "kvc_proxy_prefix_decisions_total", role="decode", result="miss") == 2
    assert metric_value(text, "kvc_proxy_prefix_decisions_total", role="decode", result="hit") == 8


def test_prefix_flags() -> None:
    cfg = parse_args(
        ["--prefill", "p:1", "--decode", "d:2", "--prefill-policy", "prefix", "--decode-policy", "prefix"]
        + ["--prefix-chunk-tokens", "32", "--prefix-cache-chunks", "500", "--prefix-balance-abs", "3", "--prefix-balance-rel", "2"]
    )
    assert cfg.prefill_policy is Policy.PREFIX and cfg.decode_policy is Policy.PREFIX
    assert cfg.prefix == PrefixSettings(32, 500, 3, 2.0)
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "p:1", "--decode", "d:2", "--prefix-chunk-tokens", "0"])


def _turns(conversation: int, turns: int) -> list[list[dict]]:
    history: list[dict] = [{"role": "system", "content": f"conversation {conversation}: " + "context " * 40}]
    out = []
    for t in range(turns):
        history = history + [{"role": "user", "content": f"question {t} " * 10}]
        out.append(list(history))
        history = history + [{"role": "assistant", "content": f"answer {t} " * 10}]
    return out


async def test_multi_turn_conversations_stay_on_their_p_and_d() -> None:
    fleet = Fleet((P1, P2), (D1, D2))
    cfg = config((P1, P2), (D1, D2), prefill_policy=Policy.PREFIX, decode_policy=Policy.PREFIX)
    conversations = [_turns(c, 4) for c in range(4)]
    async with running(cfg, fleet) as (_, client):
        for turn in range(4):
            for c, turns in enumerate(conversations):
                fleet.on_request = None
                resp = await client.post("/v1/chat/completions", json={"messages": turns[turn], "metadata": {"c": c}})
                assert resp.status_code == 200
        text = (await client.get("/metrics")).text
        health = (await client.get("/health")).json()
    by_conversation: dict[int, set[tuple[str, str]]] = {}
    calls = fleet.calls
    for i in range(0, len(calls), 2):
        p_call, d_call = calls[i], calls[i + 1]
        by_conversation.setdefault(p_call.body["metadata"]["c"], set()).add((p_call.url, d_call.url))
    assert all(len(pairs) == 1 for pairs in by_conversation.values()), by_conversation  # every turn on one P and D
    assert {next(iter(pairs))[0] for pairs in by_conversation.values()} == {P1, P2}  # and both P used
    for role in ("prefill", "decode"):
        assert metric_value(text, "kvc_proxy_prefix_decisions_total", role=role, result="hit") == 12
        assert metric_value(text, "kvc_proxy_prefix_decisions_total", role=role, result="miss") == 4
    assert all(b["prefix_chunks"] > 0 for b in health["prefill"] + health["decode"])


async def test_decode_alone_when_it_has_cached_all_but_a_few_tokens() -> None:
    fleet = Fleet((P1,), (D1,))
    cfg = config(decode_policy=Policy.PREFIX, local_prefill_below=8, prefix=PrefixSettings(chunk_tokens=4))
    first = list(range(100))
    async with running(cfg, fleet) as (_, client):
        await client.post("/v1/completions", json={"prompt": first})
        await client.post("/v1/completions", json={"prompt": first + [7, 7, 7]})  # 4 tokens not cached: D alone
        await client.post("/v1/completions", json={"prompt": first[:50] + list(range(500, 560))})  # 60 new: P too
    assert fleet.urls() == [P1, D1, D1, P1, D1]


def test_the_hit_that_decides_d_alone_is_the_one_on_the_d_the_policy_picks() -> None:
    """Under imbalance the prefix policy sends the prompt to the idlest D, which has not seen it: the
    estimated hit is that D's (none), not the busy D's, or D alone would compute the whole prompt."""
    pool = _pool(balance_abs=2, balance_rel=1.5)
    d1, d2 = pool.backends
    history = [1] * 64
    assert pool.pick(key=prompt_key(history, None, 16)) is d1
    turn = prompt_key(history + [5] * 4, None, 16)
    assert pool.expected_match(turn) == pytest.approx(64 / 68)  # balanced: d1, which has the history
    d1.outstanding, d2.outstanding = 5, 1  # load wins: d2
    assert pool.expected_match(turn) == 0.0
    assert pool.pick(key=turn) is d2  # what expected_match foresaw (and it chose nothing itself)


async def test_decode_alone_only_where_the_picked_d_has_the_prefix() -> None:
    fleet = Fleet((P1,), (D1, D2))
    cfg = config(decode=(D1, D2), decode_policy=Policy.PREFIX, local_prefill_below=8, prefix=PrefixSettings(chunk_tokens=4))
    first = list(range(100))
    async with running(cfg, fleet) as (app, client):
        await client.post("/v1/completions", json={"prompt": first})
        d1 = next(b for b in app.state.proxy.decode.backends if b.url == fleet.urls()[-1])
        d1.outstanding = 20  # busy: the next prompt goes to the other D, which has computed nothing of it
        await client.post("/v1/completions", json={"prompt": first + [7, 7, 7]})
    p_then_d = fleet.urls()[2:]
    assert p_then_d[0] == P1 and p_then_d[1] != fleet.urls()[1], fleet.urls()  # P, then the other D
