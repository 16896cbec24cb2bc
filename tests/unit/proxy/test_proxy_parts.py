"""The proxy's pieces on their own: flags, selection policies, health bookkeeping, body shaping and merging."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kv_connectors.proxy.backends import BackendPool
from kv_connectors.proxy.bodies import SseReindexer, merge_answers, merged_usage_event, split_prompts
from kv_connectors.proxy.config import BackendSpec, Flow, Policy, ProxyConfig, Role, SideChannel
from kv_connectors.proxy.flags import parse_args
from kv_connectors.proxy.metrics import ProxyMetrics
from tests.unit.proxy.proxy_fakes import D1, D2, P1, P2, config, metric_value, sse

PROXY_SCRIPT = str(Path(__file__).resolve().parents[3] / "examples" / "proxy.py")


def test_parse_args_full() -> None:
    cfg = parse_args(
        [
            "--prefill",
            "http://p1:8100/",
            "10.1.1.1:5710",
            "--prefill",
            "p2:8100",
            "5711",
            "--decode",
            "http://d1:8200",
            "--decode",
            "d2:8200",
            "--port",
            "9000",
            "--prefill-policy",
            "least_outstanding",
            "--decode-timeout-s",
            "30",
            "--max-retries",
            "0",
            "--health-interval-s",
            "0.5",
            "--unhealthy-after",
            "3",
            "--max-body-bytes",
            "4096",
            "--no-decode-only-fallback",
            "--local-prefill-below",
            "64",
        ]
    )
    assert cfg.prefill == (
        BackendSpec("http://p1:8100", SideChannel("10.1.1.1", 5710)),
        BackendSpec("http://p2:8100", SideChannel("p2", 5711)),
    )
    assert [d.url for d in cfg.decode] == ["http://d1:8200", "http://d2:8200"]
    assert cfg.resolved_flow is Flow.TRANSFER_ID and cfg.port == 9000
    assert cfg.prefill_policy is Policy.LEAST_OUTSTANDING and cfg.decode_policy is Policy.ROUND_ROBIN
    assert (cfg.decode_timeout_s, cfg.max_retries, cfg.health_interval_s, cfg.unhealthy_after, cfg.max_body_bytes) == (
        30,
        0,
        0.5,
        3,
        4096,
    )
    assert cfg.decode_only_fallback is False and cfg.local_prefill_below == 64
    defaults = parse_args(["--prefill", "p1:1", "--decode", "d:2"])
    assert defaults.decode_only_fallback is True and defaults.local_prefill_below == 0


def test_a_side_channel_names_its_data_parallel_engines() -> None:
    cfg = parse_args(["--prefill", "http://p:1", "10.0.0.1:5600,dp=2", "--prefill", "http://q:1", "5700", "--decode", "d:2"])
    dp, plain = cfg.prefill[0].side_channel, cfg.prefill[1].side_channel
    assert dp == SideChannel("10.0.0.1", 5600, 2) and str(dp) == "10.0.0.1:5600,dp=2"
    assert dp.engine(1) == SideChannel("10.0.0.1", 5601)
    assert plain == SideChannel("q", 5700) and str(plain) == "q:5700"


def test_flow_auto_is_params_unless_every_p_has_a_side_channel() -> None:
    assert parse_args(["--prefill", "p1:1", "--decode", "d:2"]).resolved_flow is Flow.PARAMS
    mixed = parse_args(["--prefill", "p1:1", "7", "--prefill", "p2:1", "--decode", "d:2"])
    assert mixed.resolved_flow is Flow.PARAMS
    forced = parse_args(["--prefill", "p1:1", "7", "--decode", "d:2", "--flow", "params"])
    assert forced.resolved_flow is Flow.PARAMS


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--decode", "d:2"], "--prefill"),
        (["--prefill", "p:1"], "--decode"),
        (["--prefill", "p:1", "1", "2", "--decode", "d:2"], "--prefill takes URL [SIDE_CHANNEL]"),
        (["--prefill", "p:1", "x", "--decode", "d:2"], "invalid side channel 'x'"),
        (["--prefill", "p:1", "h:99999", "--decode", "d:2"], "invalid side channel"),
        (["--prefill", "p:1", "h:5,dp=0", "--decode", "d:2"], "only ',dp=N'"),
        (["--prefill", "p:1", "h:5,tp=2", "--decode", "d:2"], "only ',dp=N'"),
        (["--prefill", "p:1", "h:65535,dp=2", "--decode", "d:2"], "invalid side channel"),
        (["--prefill", "ftp://p:1", "--decode", "d:2"], "invalid backend URL"),
        (["--prefill", "p:1", "--decode", "d:2", "--decode", "http://d:2/"], "lists a URL twice"),
        (["--prefill", "p:1", "--decode", "d:2", "--flow", "transfer-id"], "needs a side channel on every --prefill"),
        (["--prefill", "p:1", "--decode", "d:2", "--flow", "magic"], "--flow"),
        (["--prefill", "p:1", "--decode", "d:2", "--decode-policy", "random"], "--decode-policy"),
        (["--prefill", "p:1", "--decode", "d:2", "--prefill-timeout-s", "0"], "--prefill-timeout-s must be > 0"),
        (["--prefill", "p:1", "--decode", "d:2", "--health-timeout-s", "-1"], "--health-timeout-s must be > 0"),
        (["--prefill", "p:1", "--decode", "d:2", "--unhealthy-after", "0"], "--unhealthy-after must be >= 1"),
        (["--prefill", "p:1", "--decode", "d:2", "--max-retries", "-1"], "--max-retries must be >= 0"),
        (["--prefill", "p:1", "--decode", "d:2", "--max-body-bytes", "10"], "--max-body-bytes must be >= 1024"),
        (["--prefill", "p:1", "--decode", "d:2", "--port", "70000"], "--port must be in"),
        (["--prefill", "p:1", "--decode", "d:2", "--port", "x"], "--port"),
        (["--prefill", "p:1", "--decode", "d:2", "--local-prefill-below", "-1"], "--local-prefill-below must be >= 0"),
    ],
)
def test_bad_flags_exit_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_script_runs_and_rejects_bad_flags() -> None:
    ok = subprocess.run([sys.executable, PROXY_SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--prefill URL [SIDE_CHANNEL" in ok.stdout and "--decode-policy" in ok.stdout
    bad = subprocess.run(
        [sys.executable, PROXY_SCRIPT, "--prefill", "p:1", "--decode", "d:2", "--max-retries", "-3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--max-retries must be >= 0, got -3" in bad.stderr and "Traceback" not in bad.stderr


def test_config_validates_in_code_too() -> None:
    with pytest.raises(ValueError, match="at least one --prefill"):
        ProxyConfig(prefill=(), decode=(BackendSpec(D1),))
    with pytest.raises(ValueError, match="--decode-timeout-s"):
        config(decode_timeout_s=0)


def _pool(policy: Policy, urls: tuple[str, ...] = (D1, D2, "http://d3:1")) -> BackendPool:
    return BackendPool(Role.DECODE, [BackendSpec(u) for u in urls], policy, ProxyMetrics())


def test_round_robin_skips_unhealthy_and_excluded() -> None:
    pool = _pool(Policy.ROUND_ROBIN)
    b1, b2, b3 = pool.backends
    assert [pool.pick() for _ in range(4)] == [b1, b2, b3, b1]
    b2.healthy = False
    assert [pool.pick() for _ in range(3)] == [b3, b1, b3]
    assert pool.pick(exclude={b1}) is b3 and pool.pick(exclude={b1, b3}) is None
    assert pool.has_candidate({b1}) and not pool.has_candidate({b1, b3})


def test_least_outstanding_prefers_idle_and_rotates_ties() -> None:
    pool = _pool(Policy.LEAST_OUTSTANDING)
    b1, b2, b3 = pool.backends
    b1.outstanding, b2.outstanding, b3.outstanding = 3, 1, 1
    assert pool.pick() is b2 and pool.pick() is b3 and pool.pick() is b2
    b3.healthy = False
    b2.outstanding = 5
    assert pool.pick() is b1


def test_backend_call_counts_outstanding_served_failures() -> None:
    pool = _pool(Policy.ROUND_ROBIN, (D1,))
    [b] = pool.backends
    ok, bad = pool.begin(b), pool.begin(b)
    assert b.outstanding == 2
    ok.end(True)
    ok.end(False)  # idempotent
    bad.end(False)
    assert (b.outstanding, b.served, b.failures) == (0, 1, 1)
    text = pool.metrics.render().decode()
    assert metric_value(text, "kvc_proxy_backend_requests_total", role="decode", url=D1) == 2
    assert metric_value(text, "kvc_proxy_backend_seconds_count", role="decode", url=D1) == 2


def test_passive_and_active_health_bookkeeping() -> None:
    pool = _pool(Policy.ROUND_ROBIN, (P1, P2))
    b1, _ = pool.backends
    pool.mark_failed(b1, "refused")
    pool.mark_failed(b1, "refused again")  # already out: one eviction
    assert not b1.healthy
    pool.record_check(b1, None, unhealthy_after=2)
    assert b1.healthy
    pool.record_check(b1, "HTTP 503", unhealthy_after=2)
    assert b1.healthy
    pool.record_check(b1, "HTTP 503", unhealthy_after=2)
    assert not b1.healthy and b1.snapshot()["failures"] == 2
    text = pool.metrics.render().decode()
    assert metric_value(text, "kvc_proxy_evictions_total", role="decode") == 2
    assert metric_value(text, "kvc_proxy_backend_healthy", role="decode", url=P1) == 0


def test_split_prompts() -> None:
    route = "/v1/completions"
    assert split_prompts(route, {"prompt": "a"}) == [{"prompt": "a"}]
    assert split_prompts(route, {"prompt": [1, 2]}) == [{"prompt": [1, 2]}]
    assert split_prompts(route, {"prompt": ["a", "b"], "n": 1}) == [{"prompt": "a", "n": 1}, {"prompt": "b", "n": 1}]
    assert split_prompts(route, {"prompt": [[1], [2, 3]]}) == [{"prompt": [1]}, {"prompt": [2, 3]}]
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert split_prompts("/v1/chat/completions", chat) == [chat]


def test_merge_answers_reindexes_and_sums_usage() -> None:
    answers = [
        {
            "id": f"c{i}",
            "model": "m",
            "choices": [{"index": 0, "text": t}],
            "kv_transfer_params": None,
            "usage": {"prompt_tokens": 2, "completion_tokens": i, "total_tokens": 2 + i, "prompt_tokens_details": None},
        }
        for i, t in enumerate(["x", "y"])
    ]
    merged = merge_answers(answers)
    assert merged == {
        "id": "c0",
        "model": "m",
        "choices": [{"index": 0, "text": "x"}, {"index": 1, "text": "y"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }


def test_sse_reindexer_across_chunk_boundaries() -> None:
    r = SseReindexer(2)
    stream = (
        sse({"id": "a", "choices": [{"index": 0, "text": "hi"}]})
        + sse({"id": "a", "choices": [], "usage": {"prompt_tokens": 1, "total_tokens": 1}})
        + sse({"error": {"message": "boom"}})
        + sse("[DONE]")
    )
    out: list[bytes] = []
    for i in range(0, len(stream), 7):
        out += r.feed(stream[i : i + 7])
    out += r.flush()
    assert [json.loads(e[6:]) for e in out] == [
        {"id": "a", "choices": [{"index": 2, "text": "hi"}]},
        {"error": {"message": "boom"}},
    ]
    assert r.usage == {"prompt_tokens": 1, "total_tokens": 1}
    r2 = SseReindexer(0)
    r2.feed(sse({"id": "b", "choices": [], "usage": {"prompt_tokens": 3, "total_tokens": 4}}))
    event = merged_usage_event([r, r2])
    assert json.loads(event[6:]) == {"id": "a", "choices": [], "usage": {"prompt_tokens": 4, "total_tokens": 5}}
    assert merged_usage_event([SseReindexer(0)]) == b""


def test_proxy_process_argv_with_side_channels() -> None:
    from kvc_testing.cluster import ProxyProcess

    proc = ProxyProcess(
        ["http://p1:1", "http://p2:1"],
        ["http://d:2"],
        port=8123,
        prefill_side_channels=["10.0.0.1:5710", None],
        extra_args=["--flow", "params"],
    )
    assert proc.argv[0].endswith("kv-connectors-proxy")
    assert proc.argv[1:] == [
        "--port",
        "8123",
        "--prefill",
        "http://p1:1",
        "10.0.0.1:5710",
        "--prefill",
        "http://p2:1",
        "--decode",
        "http://d:2",
        "--flow",
        "params",
    ]
    assert parse_args(proc.argv[1:]).prefill[0].side_channel == SideChannel("10.0.0.1", 5710)
    with pytest.raises(ValueError):
        ProxyProcess(["http://p1:1"], ["http://d:2"], prefill_side_channels=[])
