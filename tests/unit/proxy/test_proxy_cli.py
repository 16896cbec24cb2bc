"""The proxy's command line fits vLLM users' habits: defaults in --help, a port that is not `vllm
serve`'s, a one-line error for a bad flag, a hint for vLLM's toy-proxy flags, --version."""

from __future__ import annotations

import re

import pytest

from kv_connectors import __version__
from kv_connectors.proxy.config import DEFAULT_PORT
from kv_connectors.proxy.flags import build_parser, parse_args

VLLM_SERVE_PORT = 8000


def _help() -> str:
    return build_parser().format_help()


def test_help_shows_every_default() -> None:
    text = re.sub(r"\s+", " ", _help())
    parser = build_parser()
    for action in parser._actions:
        if not action.option_strings or action.required or action.default in (None, False, "==SUPPRESS=="):
            continue
        flag = action.option_strings[-1]
        shown = f"(default: {action.default})"
        assert shown in text, f"{flag}: {shown} not in --help"


def test_the_default_port_is_not_vllm_serves() -> None:
    cfg = parse_args(["--prefill", "http://p:8100", "--decode", "http://d:8200"])
    assert cfg.port == DEFAULT_PORT != VLLM_SERVE_PORT


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "http://p:8100"], "the following arguments are required: --decode"),
        (["--prefill", "http://p:8100", "--decode", "http://d:8200", "--max-retries", "-1"], "--max-retries must be >= 0"),
        (["--prefill", "http://p:8100", "--decode", "http://d:8200", "--port", "eighty"], "argument --port: invalid int value"),
    ],
)
def test_a_bad_flag_is_one_line_without_the_usage_block(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and message in err and "usage:" not in err, err
    assert err.endswith("(see kv-connectors-proxy --help)\n")


@pytest.mark.parametrize("flag", ["--prefiller-hosts", "--decoder-ports", "--prefiller-port=8100"])
def test_vllm_toy_proxy_flags_get_a_hint(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [flag] if "=" in flag else [flag, "localhost"]
    with pytest.raises(SystemExit):
        parse_args([*argv, "--decode", "http://d:8200"])
    err = capsys.readouterr().err
    assert f"{flag.split('=')[0]} is a flag of vLLM's toy proxy" in err and "--prefill http://HOST:PORT" in err, err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"kv-connectors-proxy {__version__}\n"
