"""A validated, frozen ProxyConfig (backends, flow, policies, timeouts, limits) and the spellings of a
backend; flags.py builds one from the command line."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import httpx

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
class HedgeSettings:
    """Hedged prefills (params flow): a prefill still unanswered after `after_s` goes to a second P as well
    and the first answer is used, the other cancelled. `after_s` None: `factor` times the p90 of the pool's
    last `window` answered prefills (never under `floor_s`), once it has `min_samples`; no hedge before.
    At most `budget` of the recent prefills are hedges. `enabled` False: never."""

    enabled: bool = True
    after_s: float | None = None
    budget: float = 0.1
    factor: float = 2.0
    floor_s: float = 0.25
    window: int = 200
    min_samples: int = 20

    def __post_init__(self) -> None:
        if self.after_s is not None and not self.after_s > 0:
            raise ConfigError(f"--hedge-prefill must be auto, off or a number of seconds > 0, got {self.after_s}")
        if not 0 < self.budget <= 1:
            raise ConfigError(f"--hedge-budget must be in (0, 1], got {self.budget}")


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
    hedge: HedgeSettings = HedgeSettings()

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
