"""The command line -> a ProxyConfig: the parser (its --help shows every default), vLLM's toy-proxy flags
named for what they are, and one line with exit status 2 for a bad flag."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import NoReturn

from kv_connectors import __version__  # the package root only: the proxy imports nothing else of ours

from .config import (
    ADMIN_TOKEN_ENV,
    DEFAULT_PORT,
    LOG_LEVELS,
    BackendSpec,
    ConfigError,
    Flow,
    HedgeSettings,
    Policy,
    PrefixSettings,
    ProxyConfig,
    Role,
    backend_spec,
    parse_kv_events,
)


def hedge_settings(value: str, budget: float) -> HedgeSettings:
    """--hedge-prefill (auto, off, or seconds) and --hedge-budget."""
    if value.strip() in ("auto", "off"):
        return HedgeSettings(enabled=value.strip() == "auto", budget=budget)
    try:
        after_s = float(value)
    except ValueError:
        after_s = -1.0
    return HedgeSettings(after_s=after_s, budget=budget)


def _prefill_spec(values: Sequence[str]) -> BackendSpec:
    if not 1 <= len(values) <= 2:
        raise ConfigError(f"--prefill takes URL [SIDE_CHANNEL], got {list(values)}")
    return backend_spec(Role.PREFILL, values[0], values[1] if len(values) == 2 else None)


# vLLM's toy proxy (examples/.../toy_proxy_server.py) names its backends this way; ours are URLs.
TOY_PROXY_FLAGS = (
    "--prefiller-hosts",
    "--prefiller-ports",
    "--decoder-hosts",
    "--decoder-ports",
    "--prefiller-host",
    "--prefiller-port",
    "--decoder-host",
    "--decoder-port",
)
TOY_PROXY_HINT = (
    "{flag} is a flag of vLLM's toy proxy; this proxy takes one URL per server: "
    "--prefill http://HOST:PORT [SIDE_CHANNEL] (repeatable) and --decode http://HOST:PORT (repeatable)"
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except where there is none to show (required flags, unset optional ones)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line on stderr (the usage block is for --help) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kv-connectors-proxy",  # also `python examples/proxy.py`, `python -m kv_connectors.proxy`
        description="PD disaggregation proxy: N prefill and M decode vLLM servers behind one OpenAI endpoint.",
        formatter_class=_HelpFormatter,
        epilog="Docs: docs/proxy.md.",
    )
    add = parser.add_argument
    add("--version", action="version", version=f"%(prog)s {__version__}")
    add(
        "--prefill",
        action="append",
        nargs="+",
        required=True,
        metavar=("URL", "SIDE_CHANNEL"),
        help="prefill server base URL, optionally followed by its KV side channel HOST:PORT or PORT, with ,dp=N for a "
        "server of N data-parallel engines (repeatable)",
    )
    add("--decode", action="append", required=True, metavar="URL", help="decode server base URL (repeatable)")
    add("--host", default="127.0.0.1", help="address the proxy listens on")
    add("--port", type=int, default=DEFAULT_PORT, help="port the proxy listens on")
    add(
        "--flow",
        choices=[f.value for f in Flow],
        default=Flow.AUTO.value,
        help="params: P's kv_transfer_params go to D (NIXL); transfer-id: P and D at once (Mooncake push); "
        "auto: transfer-id when every --prefill has a side channel",
    )
    for role in ("prefill", "decode"):
        add(
            f"--{role}-policy",
            choices=[p.value for p in Policy],
            default=Policy.ROUND_ROBIN.value,
            help=f"how a {role} server is chosen: in turn, the fewest requests in flight, or the longest cached prefix",
        )
    add("--prefill-timeout-s", type=float, default=120.0, help="deadline of P's answer")
    add(
        "--decode-timeout-s",
        type=float,
        default=120.0,
        help="longest wait for a byte from D: its first byte, each gap between streamed chunks",
    )
    add("--health-interval-s", type=float, default=2.0, help="period of the active GET /health checks")
    add("--health-timeout-s", type=float, default=1.0, help="deadline of one GET /health check")
    add("--unhealthy-after", type=int, default=2, help="consecutive failed checks that evict a backend")
    add("--max-retries", type=int, default=2, help="retries of one request on other backends")
    add(
        "--hedge-prefill",
        default="auto",
        metavar="auto|off|SECONDS",
        help="a prefill unanswered after this long goes to a second prefill server too; the first answer is used, "
        "the other cancelled (params flow). auto: twice the p90 of the recent prefills (docs/proxy.md)",
    )
    add("--hedge-budget", type=float, default=0.1, help="largest share of the recent prefills that are hedges")
    add("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    add(
        "--decode-only-fallback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when no prefill server is left (none healthy, or each failed this request), D computes the prompt "
        "itself instead of the request failing",
    )
    add(
        "--first-token-from-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="streamed requests (params flow): P's first token goes to the client at once and D continues from "
        "prompt + that token, where the result is exact (docs/proxy.md); off: D generates every token",
    )
    add(
        "--local-prefill-below",
        type=int,
        default=0,
        metavar="N",
        help="prompts of fewer than N tokens go to D alone: no prefill server, no transfer (0: never). Text "
        "prompts are counted with a decode server's /tokenize when their length does not decide it",
    )
    add(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=tcp://HOST:PORT",
        help="the server at URL publishes vLLM's KV events there (its --kv-events-config endpoint): the prefix "
        "policy learns what it caches from them instead of estimating (token-id prompts; --prefix-chunk-tokens "
        "must be the servers' --block-size); repeatable",
    )
    add("--prefix-chunk-tokens", type=int, default=16, help="prefix policy: tokens per hashed chunk (text: 4 characters a token)")
    add("--prefix-cache-chunks", type=int, default=100_000, help="prefix policy: chunks remembered per backend (LRU)")
    add("--prefix-balance-abs", type=int, default=8, help="prefix policy: in-flight difference beyond which load wins")
    add("--prefix-balance-rel", type=float, default=1.5, help="prefix policy: in-flight ratio beyond which load wins")
    add(
        "--admin-token-env",
        default=ADMIN_TOKEN_ENV,
        metavar="NAME",
        help="environment variable holding the bearer token of the /admin endpoints (add, remove, drain "
        "backends); unset or empty: those endpoints are off. Never on the command line, where `ps` shows it",
    )
    add("--log-level", default="info", choices=list(LOG_LEVELS), help="log level of the proxy and uvicorn")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> ProxyConfig:
    """Parse and validate; a bad flag exits with status 2 and a message naming it."""
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    for arg in given:
        flag = arg.split("=", 1)[0]
        if flag in TOY_PROXY_FLAGS:
            parser.error(TOY_PROXY_HINT.format(flag=flag))
    args = parser.parse_args(given)
    try:
        events = dict(parse_kv_events(v) for v in args.kv_events)
        prefill = tuple(_prefill_spec(v) for v in args.prefill)
        decode = tuple(backend_spec(Role.DECODE, u) for u in args.decode)
        unknown = sorted(set(events) - {s.url for s in (*prefill, *decode)})
        if unknown:
            raise ConfigError(f"--kv-events names servers that are neither --prefill nor --decode: {unknown}")
        return ProxyConfig(
            prefill=tuple(replace(s, kv_events=events.get(s.url)) for s in prefill),
            decode=tuple(replace(s, kv_events=events.get(s.url)) for s in decode),
            host=args.host,
            port=args.port,
            flow=Flow(args.flow),
            prefill_policy=Policy(args.prefill_policy),
            decode_policy=Policy(args.decode_policy),
            prefill_timeout_s=args.prefill_timeout_s,
            decode_timeout_s=args.decode_timeout_s,
            health_interval_s=args.health_interval_s,
            health_timeout_s=args.health_timeout_s,
            unhealthy_after=args.unhealthy_after,
            max_retries=args.max_retries,
            max_body_bytes=args.max_body_bytes,
            log_level=args.log_level,
            decode_only_fallback=args.decode_only_fallback,
            first_token_from_prefill=args.first_token_from_prefill,
            local_prefill_below=args.local_prefill_below,
            admin_token=os.environ.get(args.admin_token_env, ""),
            prefix=PrefixSettings(
                args.prefix_chunk_tokens, args.prefix_cache_chunks, args.prefix_balance_abs, args.prefix_balance_rel
            ),
            hedge=hedge_settings(args.hedge_prefill, args.hedge_budget),
        )
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
