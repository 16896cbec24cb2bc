"""bench_e2e.py's figures and configuration plumbing: statistics, ratios, evaluation, server settings (no servers)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from benchmarks.e2e.bench_e2e import failed_entry, make_workload, parse_args
from benchmarks.e2e.client import RequestFailed, evaluate, request_body
from benchmarks.e2e.configs import (
    BASELINE_TREE_ENV,
    BUILTIN_LAUNCHER,
    CONFIGS,
    DEFAULT_CONFIGS,
    MIN_KV_CACHE_BYTES,
    PROGRESS_DELAY_ENV,
    builtin_server,
    parse_configs,
    settings_for,
)
from benchmarks.e2e.stats import (
    RATIO_FIGURES,
    Sample,
    add_ratios,
    builtin_baseline,
    figures_table,
    kv_figures,
    percentile,
    ratio,
    ratios_table,
    summarize,
)
from benchmarks.plots import line_plot
from kvc_testing.procs import MiB


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [10.0, 20.0, 30.0, 40.0]
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile(values, 50) == 25.0
    assert math.isclose(percentile(values, 99), 39.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_means_percentiles_and_per_length():
    samples = [
        Sample(128, 0.010, 0.050, (1, 2, 3, 4)),
        Sample(128, 0.030, 0.070, (1, 2, 3, 4)),
        Sample(256, 0.020, 0.100, (5, 6, 7, 8), first_chunk_tokens=3),
    ]
    s = summarize(samples, wall_s=0.2)
    assert s["requests"] == 3
    assert s["ttft_mean_ms"] == 20.0
    assert s["ttft_p50_ms"] == 20.0
    assert s["ttft_p99_ms"] == pytest.approx(29.8)
    assert s["e2e_mean_ms"] == pytest.approx(73.333, abs=1e-3)
    assert s["output_tokens"] == 12
    assert s["output_tok_s"] == 60.0
    assert s["ttft_by_length_ms"] == {"128": 20.0, "256": 20.0}
    assert s["e2e_by_length_ms"] == {"128": 60.0, "256": 100.0}
    assert s["first_chunk_tokens_mean"] == pytest.approx(5 / 3, abs=0.01)
    with pytest.raises(ValueError):
        summarize([], 1.0)
    with pytest.raises(ValueError):
        summarize(samples, 0.0)


def test_kv_figures_and_ratio_handle_unknowns():
    assert kv_figures(2_000_000_000, 2.0)["gbps"] == 1.0
    # a slow load (vLLM's built-in connector on a loaded 2-core host: 224 KiB in 0.6 s) is slow, not 0
    assert kv_figures(229_376, 0.6)["gbps"] == 0.0003823
    assert kv_figures(None, None) == {"kv_bytes": None, "kv_seconds": None, "gbps": None}
    assert kv_figures(100, 0.0)["gbps"] is None
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0) is None


def _entry(ttft: float, gbps: float | None, ok: bool = True) -> dict:
    figures = {f: None for f in RATIO_FIGURES}
    if ok:
        figures.update(
            ttft_mean_ms=ttft,
            ttft_p50_ms=ttft,
            ttft_p99_ms=2 * ttft,
            e2e_mean_ms=3 * ttft,
            output_tok_s=100.0,
            kv_bytes=None if gbps is None else 1000,
            gbps=gbps,
        )
    return {"ok": ok, **figures}


def test_add_ratios_against_builtin_and_colocated():
    results = {"colocated": _entry(10.0, None), "ours-nixl-pull": _entry(40.0, 2.0), "builtin-nixl": _entry(80.0, 1.0)}
    add_ratios(results)
    ours = results["ours-nixl-pull"]
    assert ours["vs_builtin"]["ttft_mean_ms"] == 0.5
    assert ours["vs_builtin"]["gbps"] == 2.0
    assert ours["vs_builtin"]["kv_bytes"] == 1.0
    assert ours["vs_colocated"]["ttft_mean_ms"] == 4.0
    assert ours["vs_colocated"]["gbps"] is None  # colocated moves no KV
    assert results["builtin-nixl"]["vs_builtin"]["ttft_mean_ms"] == 1.0
    assert results["colocated"]["vs_colocated"]["e2e_mean_ms"] == 1.0
    assert set(ours["vs_builtin"]) == set(RATIO_FIGURES)
    text = figures_table(results) + ratios_table(results)
    assert "ours-nixl-pull" in text and "n/a" in text


def test_failed_or_absent_baseline_gives_no_ratios():
    results = {"colocated": _entry(10.0, None), "ours-nixl-pull": _entry(40.0, 2.0), "builtin-nixl": _entry(0.0, None, ok=False)}
    add_ratios(results)
    assert all(v is None for v in results["ours-nixl-pull"]["vs_builtin"].values())
    assert results["ours-nixl-pull"]["vs_colocated"]["ttft_mean_ms"] == 4.0
    del results["builtin-nixl"]
    add_ratios(results)
    assert all(v is None for v in results["ours-nixl-pull"]["vs_builtin"].values())


def test_the_tuned_builtin_is_the_baseline_where_the_shipped_one_is_not_in_the_run():
    results = {"ours-nixl-pull": _entry(40.0, 2.0), "builtin-nixl-patched": _entry(50.0, 1.0)}
    assert builtin_baseline(results) == "builtin-nixl-patched"
    add_ratios(results)
    assert results["ours-nixl-pull"]["vs_builtin"]["ttft_mean_ms"] == 0.8
    results["builtin-nixl"] = _entry(80.0, 1.0)  # as shipped, when present, stays the baseline
    assert builtin_baseline(results) == "builtin-nixl"
    add_ratios(results)
    assert results["ours-nixl-pull"]["vs_builtin"]["ttft_mean_ms"] == 0.5
    assert builtin_baseline({"ours-nixl-pull": {}}) is None


def test_evaluate_fails_a_configuration_on_a_mismatch_or_an_error():
    ref = [(1, 2), (3, 4)]
    good = [Sample(64, 0.01, 0.02, (1, 2)), Sample(128, 0.01, 0.02, (3, 4))]
    figures, error, details = evaluate(good, 1.0, ref, [64, 128])
    assert error is None and figures is not None and details["mismatches"] == 0
    figures, error, details = evaluate([good[0], Sample(128, 0.01, 0.02, (3, 5))], 1.0, ref, [64, 128])
    assert figures is None and "differ from colocated" in error and details["mismatch_lengths"] == [128]
    figures, error, details = evaluate([good[0], RequestFailed("HTTP 500")], 1.0, ref, [64, 128])
    assert figures is None and "HTTP 500" in error and details["failed_requests"] == 1
    entry = failed_entry("d", error, **details)
    assert entry["ok"] is False and entry["ttft_mean_ms"] is None and entry["gbps"] is None
    json.dumps(entry)


def test_workload_prompts_are_distinct_and_seeded():
    w = make_workload([64, 128], repeats=3, seed=5, max_tokens=4, concurrency=2, timeout_s=10)
    assert [len(p) for p in w.prompts] == [64, 128] * 3
    assert len(set(w.prompts)) == 6  # no prompt repeats: no prefix-cache hit anywhere
    assert not set(w.prompts) & set(w.warmup)
    assert w.prompts == make_workload([64, 128], 3, 5, 4, 2, 10).prompts
    assert w.prompt_tokens == 3 * 192
    body = request_body(w.prompts[0], 4)
    assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0 and body["return_token_ids"]


def test_settings_fit_the_longest_prompt_and_the_tokens_in_flight(tmp_path: Path):
    s = settings_for(tmp_path, "tiny", 1000, 16, concurrency=1)
    assert s.max_model_len == 1024 and s.max_model_len % s.block_size == 0
    assert s.kv_cache_bytes == MIN_KV_CACHE_BYTES
    big = settings_for(tmp_path, "medium", 2048, 16, concurrency=4)
    assert big.max_model_len >= 2064
    assert big.kv_cache_bytes >= 2 * 4 * 2064 * 72 * 1024 and big.kv_cache_bytes % MiB == 0
    assert big.staging["staging_pool_kib"] * 1024 <= big.kv_cache_bytes // 8
    assert big.staging["staging_pool_kib"] >= 2 * big.staging["staging_chunk_kib"]
    with pytest.raises(ValueError, match="exceeds the tiny model's 2048 positions"):
        settings_for(tmp_path, "tiny", 2048, 16, concurrency=1)


def test_config_names_are_checked():
    assert parse_configs("ours-nixl-pull, builtin-nixl,ours-nixl-pull") == ["ours-nixl-pull", "builtin-nixl"]
    with pytest.raises(ValueError, match="unknown configuration"):
        parse_configs("ours-nixl-pull,nope")
    assert set(DEFAULT_CONFIGS) <= set(CONFIGS)
    with pytest.raises(SystemExit):
        parse_args(["--configs", "nope"])
    with pytest.raises(SystemExit):
        parse_args(["--lengths", "1,128"])
    args = parse_args(["--model-size", "small"])
    assert max(args.length_list) == 2048 and args.config_names == list(DEFAULT_CONFIGS)
    assert parse_args(["--interleave"]).interleave
    with pytest.raises(SystemExit):
        parse_args(["--interleave", "--concurrency", "4"])  # one request at a time


def test_builtin_servers_take_their_side_channel_port_from_the_environment(tmp_path: Path):
    s = settings_for(tmp_path, "tiny", 128, 8, concurrency=1)
    shipped = builtin_server(s, "kv_producer", "P")
    assert shipped.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(shipped.side_channel_port)
    cfg = json.loads(shipped.argv[shipped.argv.index("--kv-transfer-config") + 1])
    assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    assert "vllm.entrypoints.openai.api_server" in shipped.argv
    patched = builtin_server(s, "kv_consumer", "D", progress_delay_us=1000)
    assert str(BUILTIN_LAUNCHER) in patched.argv and "vllm.entrypoints.openai.api_server" not in patched.argv
    assert patched.env[PROGRESS_DELAY_ENV] == "1000" and PROGRESS_DELAY_ENV not in shipped.env
    assert f'PROGRESS_DELAY_ENV = "{PROGRESS_DELAY_ENV}"' in BUILTIN_LAUNCHER.read_text()  # (importing it patches)


def test_baseline_servers_run_in_the_baseline_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`python -m` puts the working directory first on sys.path, before PYTHONPATH: run from this
    repository, the baseline's servers would import this checkout's kv_connectors."""
    tree = tmp_path / "old"
    (tree / "kv_connectors").mkdir(parents=True)
    monkeypatch.setenv(BASELINE_TREE_ENV, str(tree))
    p, d = CONFIGS["ours-nixl-pull-baseline"].build(settings_for(tmp_path, "tiny", 128, 8, concurrency=1))
    for server in (p, d):
        assert server.cwd == str(tree) and server.env["PYTHONPATH"] == str(tree)
    ours, _ = CONFIGS["ours-nixl-pull"].build(settings_for(tmp_path, "tiny", 128, 8, concurrency=1))
    assert ours.cwd is None


def test_line_plot_writes_a_png(tmp_path: Path):
    out = line_plot(
        {"a": ([128, 256], [10.0, 20.0]), "b": ([128, 256], [12.0, 30.0])},
        tmp_path / "p.png",
        title="t",
        xlabel="x",
        ylabel="y",
        logx=True,
        note="n",
    )
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300 and height > 200


def test_pin_puts_every_p_on_its_cores_and_every_d_and_colocated_on_theirs(tmp_path: Path):
    """bench_e2e --pin 0:1: ours and the built-in get the same cores (taskset), whatever the scheduler does."""
    import dataclasses

    from benchmarks.e2e.configs import colocated_server

    args = parse_args(["--pin", "0:1"])
    assert args.pin == ("0", "1")
    with pytest.raises(SystemExit):
        parse_args(["--pin", "0"])
    pinned = dataclasses.replace(settings_for(tmp_path, "tiny", 128, 8, concurrency=1), p_cpus="0", d_cpus="1")
    for name in ("ours-nixl-pull", "builtin-nixl-patched", "builtin-nixl"):
        p, d = CONFIGS[name].build(pinned)
        assert p.argv[:3] == ["taskset", "-c", "0"], (name, p.argv[:4])
        assert d.argv[:3] == ["taskset", "-c", "1"], (name, d.argv[:4])
    assert colocated_server(pinned).argv[:3] == ["taskset", "-c", "1"]
    p, d = CONFIGS["ours-nixl-pull"].build(settings_for(tmp_path, "tiny", 128, 8, concurrency=1))
    assert "taskset" not in p.argv and "taskset" not in d.argv  # unpinned by default
