"""Command line -> a validated, frozen ProxyConfig (backends, flow, policies, timeouts, limits)."""

from __future__ import annotations

import argparse
import enum
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NoReturn

import httpx

from kv_connectors import __version__  # the package root only: the proxy imports nothing else of ours

DEFAULT_PORT = 8080  # not vLLM's 8000: the proxy often runs on a host that also runs `vllm serve`


class ConfigError(ValueError):
    """A bad proxy setting; the message names the flag and the valid values."""


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Flow(str, enum.Enum):
    """How P and D are addressed: P's answer forwarded to D (NIXL), or both at once with a transfer id."""

    AUTO = "auto"
    PARAMS = "params"
    TRANSFER_ID = "transfer-id"


class Policy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    PREFIX = "prefix"  # the backend that has seen the longest prefix of the prompt, unless load is imbalanced


@dataclass(frozen=True)
class PrefixSettings:
    """The prefix policy: chunk size, each backend's LRU capacity, and when load overrides cache affinity
    (the busiest candidate has more than `balance_abs` more requests in flight than the idlest, and more
    than `balance_rel` times as many: then the idlest is chosen)."""

    chunk_tokens: int = 16
    capacity: int = 100_000  # chunks per backend
    balance_abs: int = 8
    balance_rel: float = 1.5


@dataclass(frozen=True)
class SideChannel:
    """A prefill server's KV side-channel address (what D contacts in the transfer-id flow). A server
    of dp_size data-parallel engines runs one per engine, engine r's at port + r (the connector's
    layout, as the built-in's): the proxy then picks the engine (vLLM's X-data-parallel-rank header)
    and names its side channel to D."""

    host: str
    port: int
    dp_size: int = 1

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" + (f",dp={self.dp_size}" if self.dp_size > 1 else "")

    def engine(self, dp_rank: int) -> SideChannel:
        """Data-parallel engine dp_rank's side channel."""
        return SideChannel(self.host, self.port + dp_rank)


@dataclass(frozen=True)
class BackendSpec:
    url: str
    side_channel: SideChannel | None = None
    kv_events: str | None = None  # its vLLM KV event publisher (ZMQ endpoint): the prefix policy learns from it


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[BackendSpec, ...]
    decode: tuple[BackendSpec, ...]
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    flow: Flow = Flow.AUTO
    prefill_policy: Policy = Policy.ROUND_ROBIN
    decode_policy: Policy = Policy.ROUND_ROBIN
    prefill_timeout_s: float = 120.0
    decode_timeout_s: float = 120.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    unhealthy_after: int = 2
    max_retries: int = 2
    max_body_bytes: int = 8 << 20
    log_level: str = "info"
    decode_only_fallback: bool = True
    local_prefill_below: int = 0
    admin_token: str = field(default="", repr=False)  # "": the admin endpoints are off
    first_token_from_prefill: bool = True
    prefix: PrefixSettings = PrefixSettings()

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ConfigError("need at least one --prefill URL")
        if not self.decode:
            raise ConfigError("need at least one --decode URL")
        for role, specs in (("prefill", self.prefill), ("decode", self.decode)):
            urls = [s.url for s in specs]
            if len(set(urls)) != len(urls):
                raise ConfigError(f"--{role} lists a URL twice: {urls}")
        if self.flow is Flow.TRANSFER_ID and any(s.side_channel is None for s in self.prefill):
            missing = [s.url for s in self.prefill if s.side_channel is None]
            raise ConfigError(f"--flow transfer-id needs a side channel on every --prefill (missing on {missing})")
        for name in ("prefill_timeout_s", "decode_timeout_s", "health_interval_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{_flag(name)} must be > 0, got {getattr(self, name)}")
        if self.unhealthy_after < 1:
            raise ConfigError(f"--unhealthy-after must be >= 1, got {self.unhealthy_after}")
        if self.max_retries < 0:
            raise ConfigError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        p = self.prefix
        if not 1 <= p.chunk_tokens <= 4096:
            raise ConfigError(f"--prefix-chunk-tokens must be in 1..4096, got {p.chunk_tokens}")
        if p.capacity < 1:
            raise ConfigError(f"--prefix-cache-chunks must be >= 1, got {p.capacity}")
        if p.balance_abs < 0 or not p.balance_rel >= 1:
            raise ConfigError(
                f"--prefix-balance-abs must be >= 0 and --prefix-balance-rel >= 1, got {p.balance_abs} and {p.balance_rel}"
            )
        for role, specs, policy in (("prefill", self.prefill, self.prefill_policy), ("decode", self.decode, self.decode_policy)):
            if policy is not Policy.PREFIX and any(s.kv_events for s in specs):
                raise ConfigError(f"--kv-events on a {role} server needs --{role}-policy prefix (its events feed that policy)")
        if self.local_prefill_below < 0:
            raise ConfigError(f"--local-prefill-below must be >= 0, got {self.local_prefill_below}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")

    @property
    def resolved_flow(self) -> Flow:
        """auto: transfer-id when every prefill server has a side channel, else params."""
        if self.flow is not Flow.AUTO:
            return self.flow
        if all(s.side_channel is not None for s in self.prefill):
            return Flow.TRANSFER_ID
        return Flow.PARAMS


LOG_LEVELS = ("debug", "info", "warning", "error")
ADMIN_TOKEN_ENV = "KVC_PROXY_ADMIN_TOKEN"


def _flag(field_name: str) -> str:
    return field_name.replace("_", "-")


def normalize_url(url: str) -> str:
    """'host:port' or 'http://host:port/' -> 'http://host:port'; ConfigError if not http(s) with a host."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ConfigError(f"invalid backend URL {url!r}: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"invalid backend URL {url!r}: need http(s)://host[:port]")
    return url


MAX_DP_SIZE = 1024


def parse_side_channel(value: str, url: str) -> SideChannel:
    """'host:port' or 'port' (host taken from the URL), then ',dp=N' for a server of N data-parallel
    engines (engine r's side channel on port + r)."""
    address, *options = value.strip().split(",")
    dp_size = 1
    for option in options:
        key, _, number = option.partition("=")
        if key.strip() != "dp" or not number.strip().isdigit() or not 1 <= int(number) <= MAX_DP_SIZE:
            raise ConfigError(
                f"invalid side channel {value!r} for --prefill {url}: after HOST:PORT only ',dp=N' "
                f"(its data-parallel engines, 1..{MAX_DP_SIZE})"
            )
        dp_size = int(number)
    host, sep, port_text = address.rpartition(":")
    if not sep:
        host = httpx.URL(url).host
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not host or not 1 <= port <= 65535 or port + dp_size - 1 > 65535:
        raise ConfigError(f"invalid side channel {value!r} for --prefill {url}: expected HOST:PORT or PORT[,dp=N]")
    return SideChannel(host, port, dp_size)


def backend_spec(role: Role, url: str, side_channel: str | None = None) -> BackendSpec:
    """A backend from its flag or admin-request spelling; ConfigError naming what is wrong."""
    url = normalize_url(url)
    if side_channel is not None and role is Role.DECODE:
        raise ConfigError(f"a decode server has no side channel ({url} {side_channel})")
    return BackendSpec(url, parse_side_channel(side_channel, url) if side_channel is not None else None)


def parse_kv_events(value: str) -> tuple[str, str]:
    """'URL=tcp://HOST:PORT': a server's URL and its KV event publisher's ZMQ endpoint."""
    url, sep, endpoint = value.partition("=")
    scheme, _, address = endpoint.strip().partition("://")
    host, _, port = address.rpartition(":")
    if not sep or scheme != "tcp" or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"invalid --kv-events {value!r}: expected URL=tcp://HOST:PORT (the server's --kv-events-config endpoint)")
    return normalize_url(url), endpoint.strip()


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
        )
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
