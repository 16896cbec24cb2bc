"""`check-config --model`: a model's cached layers by kind read from its config.json, and the verdict
start-up gives (one kind, or full and sliding-window attention only: served; anything else among
several kinds: refused, naming it). The configs below carry the keys of the public configs of each
family (the layer counts cut short); the tiny hybrids are the ones the e2e tests serve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kv_connectors import cli, modelgroups
from kv_connectors.errors import ConfigError
from kv_connectors.modelgroups import CHUNKED, FULL, LINEAR, MAMBA, MLA, SLIDING

NIXL_P = json.dumps({"kv_connector": "NixlConnector", "kv_connector_module_path": "kv_connectors.nixl", "kv_role": "kv_producer"})

GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "num_hidden_layers": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}
GEMMA3_MULTIMODAL = {  # gemma-3-*-it: the language model's keys under text_config, no layer_types
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 1024, "sliding_window_pattern": 6},
    "vision_config": {"model_type": "siglip_vision_model"},
}
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 4096}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 3}
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_hidden_layers": 3, "sliding_window": 4096}
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "num_hidden_layers": 3,
    "sliding_window": 32768,
    "use_sliding_window": False,
}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 3, "kv_lora_rank": 512}
LLAMA4 = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "text_config": {"model_type": "llama4_text", "num_hidden_layers": 8, "attention_chunk_size": 8192, "no_rope_layers": []},
}
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
}
JAMBA = {
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "num_hidden_layers": 4,
    "layers_block_type": ["mamba", "mamba", "attention", "mamba"],
}
NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "num_hidden_layers": 6,
    "hybrid_override_pattern": "M-M*-E",
}
FALCON_H1 = {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "num_hidden_layers": 2}


def _kinds(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], int]]:
    return {k.kind: (k.layers, k.window) for k in modelgroups.model_groups(config).kinds}


@pytest.mark.parametrize(
    "config, kinds",
    [
        (GPT_OSS, {SLIDING: ((0, 2), 128), FULL: ((1, 3), 0)}),
        (GEMMA3_MULTIMODAL, {SLIDING: ((0, 1, 2, 3, 4, 6, 7, 8, 9, 10), 1024), FULL: ((5, 11), 0)}),
        (GEMMA2, {SLIDING: ((0, 2), 4096), FULL: ((1, 3), 0)}),
    ],
    ids=["gpt-oss", "gemma-3-multimodal", "gemma-2"],
)
def test_sliding_window_beside_full_attention_is_served(config: dict[str, Any], kinds: dict[str, Any]) -> None:
    groups = modelgroups.model_groups(config)
    assert _kinds(config) == kinds
    assert groups.hybrid and groups.served and groups.refusal == ""
    assert modelgroups.ModelGroups.from_dict(groups.as_dict()) == groups  # the doctor renders from the dict


@pytest.mark.parametrize(
    "config, kind",
    [(LLAMA, FULL), (MISTRAL, SLIDING), (QWEN2, FULL), (DEEPSEEK_V3, MLA)],
    ids=["llama", "mistral-all-sliding", "qwen2-window-off", "deepseek-v3-mla"],
)
def test_one_kind_of_layer_is_one_group_and_served(config: dict[str, Any], kind: str) -> None:
    groups = modelgroups.model_groups(config)
    assert list(_kinds(config)) == [kind] and not groups.hybrid and groups.served


@pytest.mark.parametrize(
    "config, kinds, named",
    [
        (LLAMA4, {CHUNKED: ((0, 1, 2, 4, 5, 6), 8192), FULL: ((3, 7), 0)}, "chunked_attention layers (layers 0-2, 4-6)"),
        (QWEN3_NEXT, {LINEAR: ((0, 1, 2, 4, 5, 6), 0), FULL: ((3, 7), 0)}, "linear_attention layers (layers 0-2, 4-6)"),
        (JAMBA, {MAMBA: ((0, 1, 3), 0), FULL: ((2,), 0)}, "mamba layers (layers 0-1, 3)"),
        (NEMOTRON_H, {MAMBA: ((0, 2), 0), FULL: ((3,), 0)}, "mamba layers (layers 0, 2)"),
        (FALCON_H1, {FULL: ((0, 1), 0), MAMBA: ((0, 1), 0)}, "mamba layers (layers 0-1)"),
    ],
    ids=["llama-4", "qwen3-next", "jamba", "nemotron-h", "falcon-h1"],
)
def test_a_kind_we_do_not_move_beside_others_is_refused_naming_it(config: dict[str, Any], kinds: dict, named: str) -> None:
    groups = modelgroups.model_groups(config)
    assert _kinds(config) == kinds
    assert not groups.served and named in groups.refusal and "does not start" in groups.refusal


def test_mla_among_several_kinds_is_refused() -> None:
    config = {**GPT_OSS, "kv_lora_rank": 512}
    groups = modelgroups.model_groups(config)
    assert _kinds(config) == {"sliding_window_mla": ((0, 2), 128), MLA: ((1, 3), 0)}
    assert "sliding_window_mla layers (layers 0, 2) in a model of several KV cache groups" in groups.refusal


@pytest.mark.parametrize(
    "config, why",
    [
        ({"model_type": "llama"}, "no usable num_hidden_layers"),
        ({**GPT_OSS, "num_hidden_layers": 6}, "lists 4 layer_types for 6 layers"),
        ({**LLAMA, "num_hidden_layers": "3"}, "no usable num_hidden_layers"),
    ],
)
def test_a_config_that_does_not_say_is_a_clear_error(config: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        modelgroups.model_groups(config)


def test_the_tiny_hybrids_the_e2e_tests_serve_read_as_served(tmp_path: Path) -> None:
    """The configs transformers writes for kvc_testing's tiny Gemma 3 and gpt-oss (the e2e tests serve
    them greedy-exact): two kinds, served."""
    from transformers import Gemma3TextConfig, GptOssConfig

    from kvc_testing.hybrid_model import FAMILIES, SLIDING_WINDOW

    for name, cls in (("gemma3", Gemma3TextConfig), ("gpt_oss", GptOssConfig)):
        cls(**FAMILIES[name]).save_pretrained(tmp_path / name)
        config = modelgroups.read_config(tmp_path / name)
        groups = modelgroups.model_groups(config)
        assert _kinds(config) == {SLIDING: ((0, 2), SLIDING_WINDOW), FULL: ((1, 3), 0)}, config
        assert groups.served and groups.hybrid


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = cli.main(["check-config", NIXL_P, *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_check_config_shows_the_models_kinds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS))
    code, out = _cli(capsys, "--model", str(tmp_path))
    assert code == 0 and out["ok"]
    assert out["model"] == {
        "architecture": "GptOssForCausalLM",
        "served": True,
        "refusal": None,
        "kinds": [{"kind": SLIDING, "layers": [0, 2], "window": 128}, {"kind": FULL, "layers": [1, 3], "window": None}],
    }
    assert cli.main(["check-config", NIXL_P, "--model", str(tmp_path / "config.json")]) == 0
    text = capsys.readouterr().out
    assert "model: GptOssForCausalLM, hybrid, served" in text
    assert "sliding_attention (window 128): 2 layers (layers 0, 2)" in text


def test_check_config_exits_2_for_a_model_start_up_would_refuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT))
    code, out = _cli(capsys, "--model", str(tmp_path))
    assert code == 2 and not out["ok"]
    assert "Qwen3NextForCausalLM" in out["error"] and "linear_attention layers" in out["error"]
    assert out["model"]["served"] is False
    assert cli.main(["check-config", NIXL_P, "--model", str(tmp_path)]) == 2
    assert "error: model" in capsys.readouterr().err


def test_check_config_names_a_model_path_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli(capsys, "--model", str(tmp_path / "nowhere"))
    assert code == 2 and "cannot read the model's config" in out["error"] and "nowhere" in out["error"]
    (tmp_path / "config.json").write_text("[1, 2]")
    code, out = _cli(capsys, "--model", str(tmp_path))
    assert code == 2 and "is not a JSON object" in out["error"]


def test_doctor_shows_the_models_kinds_and_exits_2_for_a_refused_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    served, refused = tmp_path / "gpt-oss", tmp_path / "jamba"
    for folder, config in ((served, GPT_OSS), (refused, JAMBA)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    assert cli.main(["doctor", "--no-probe", "--json", "--model", str(served)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["path"] == str(served) and report["model"]["served"] is True
    assert [k["kind"] for k in report["model"]["kinds"]] == [SLIDING, FULL]
    assert cli.main(["doctor", "--no-probe", "--model", str(served)]) == 0
    out = capsys.readouterr().out
    assert "model: GptOssForCausalLM, hybrid, served" in out and "  sliding_attention (window 128): 2 layers" in out
    assert cli.main(["doctor", "--no-probe", "--model", str(refused)]) == 2
    assert "MODEL PROBLEM: model: JambaForCausalLM, hybrid, refused: mamba layers (layers 0-1, 3)" in capsys.readouterr().out
    assert cli.main(["doctor", "--no-probe", "--json", "--model", str(tmp_path / "nowhere")]) == 2
    assert "cannot read the model's config" in json.loads(capsys.readouterr().out)["model"]["error"]
