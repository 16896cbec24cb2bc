"""Connector configuration: `kv_connector_extra_config` parsed and validated once into a typed object."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from kv_connectors.affinity import check_engine_cpus
from kv_connectors.errors import ConfigError

logger = logging.getLogger(__name__)


class TransferMode(enum.Enum):
    """Who drives the data movement: D reads from P (pull) or P writes into D (push).

    Chosen on the decode side; a prefill instance serves both.
    """

    PULL = "pull"
    PUSH = "push"


class Staging(enum.Enum):
    """CPU staging through a bounded host pool: auto = only when device memory cannot be registered;
    fragmented = the KV cache registered too, and only plans of many short runs staged (a
    transport's cost per run; kv_connectors.transports.staging.direct)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"
    FRAGMENTED = "fragmented"


class PortLayout(enum.Enum):
    """Where an instance's side channels listen (`side_channel_ports`).

    INSTANCE (vLLM's built-in layout): one port per instance, `side_channel_port` plus the
    data-parallel index; tensor-parallel rank 0 listens there and names the others, which listen on
    ports the system picks. RANK: every rank on a port known in advance (firewalls that open
    ports one by one): rank r of data-parallel engine d at `side_channel_port + d * TP + r`."""

    INSTANCE = "instance"
    RANK = "rank"


class Role(enum.Enum):
    """The instance's part in disaggregation (vLLM's kv_role)."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @property
    def produces(self) -> bool:
        return self in (Role.PRODUCER, Role.BOTH)

    @property
    def consumes(self) -> bool:
        return self in (Role.CONSUMER, Role.BOTH)


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """Everything a connector needs to know, checked once at start-up."""

    engine_id: str
    role: Role
    side_channel_host: str = "127.0.0.1"  # what P advertises to D (and binds, unless side_channel_bind_host)
    side_channel_port: int = 5710
    side_channel_ports: PortLayout = PortLayout.INSTANCE
    side_channel_bind_host: str = ""  # e.g. "0.0.0.0" on a multi-host set-up; "" binds side_channel_host
    side_channel_max_msg_kib: int = 16 * 1024  # larger frames are dropped unread (ZMQ_MAXMSGSIZE)
    # Shared-secret authentication of side-channel messages (HMAC-SHA256): the name of an environment
    # variable holding the secret, read once at start-up; "" = off.
    side_channel_secret_env: str = ""
    side_channel_secret: bytes = dataclasses.field(default=b"", repr=False)
    lease_s: float = 30.0
    # D: a request still queued on D this long gets heartbeats that keep P's lease alive.
    lease_renew_after_s: float = 0.5
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    # D: a failed load whose transfer may still move bytes is reported to vLLM only once it ended
    # (kv_connectors.consumer.tasks: SETTLING); past this it is counted and logged as quarantined,
    # its blocks still held until the transport or the producer says no byte can land.
    settle_timeout_s: float = 30.0
    mode: TransferMode = TransferMode.PULL
    nixl_backend: str = "UCX"
    progress_delay_us: int = 1000
    # UCX worker threads of the NIXL agent, as vLLM's built-in (4): a post returns at once and a
    # fragmented block table moves at the coalesced speed; 0: NIXL's default, the copy runs inside
    # the post call on the engine thread.
    nixl_num_threads: int = 4
    mooncake_protocol: str = "tcp"
    mooncake_device_name: str = ""
    # Host KV regions on transparent huge pages at registration (kv_connectors.hugepages).
    host_huge_pages: bool = True
    staging: Staging = Staging.AUTO
    staging_pool_kib: int = 64 * 1024  # DEFAULT_POOL_KIB
    staging_chunk_kib: int = 4096  # parse_config: min(4096, staging_pool_kib // 8) unless set
    # staging "fragmented": a plan of at least this many runs, averaging under this many KiB, is staged
    staging_fragment_runs: int = 256
    staging_fragment_kib: int = 64
    # P, transfer-id flow: write each layer's blocks to a waiting D as soon as the layer is computed.
    layerwise: bool = True
    # The longest wait after a vLLM step that scheduled no token and finished no transfer, before the
    # next (kv_connectors.idle); 0: vLLM steps back to back, spinning a core.
    idle_wait_ms: float = 2.0
    # Pin vLLM's engine thread (and the threads it starts later) at connector creation: "" leaves it,
    # "builtin" does what vLLM's built-in NixlConnector does on CPU platforms (the last core of each
    # NUMA node), or a CPU list ("0-3,8"). kv_connectors.affinity says why.
    engine_cpus: str = ""
    # Pull's fence: D reads P's lease words after its data read (kv_connectors.fence) and claims the
    # lease over the side channel only when they do not prove it live; False: always claim.
    lease_words: bool = True

    @property
    def bind_host(self) -> str:
        return self.side_channel_bind_host or self.side_channel_host

    def instance_port(self, dp_index: int = 0, tp_size: int = 1) -> int:
        """The port an instance's params name (its rank 0 listens there): see PortLayout."""
        if self.side_channel_ports is PortLayout.RANK:
            return self.side_channel_port + dp_index * tp_size
        return self.side_channel_port + dp_index

    def rank_port(self, rank: int, dp_index: int = 0, tp_size: int = 1) -> int:
        """Where tensor-parallel rank `rank` listens; 0: a free port the system picks (PortLayout)."""
        if rank == 0 or self.side_channel_ports is PortLayout.RANK:
            return self.instance_port(dp_index, tp_size) + rank
        return 0

    def check_ports(self, dp_index: int, tp_size: int) -> None:
        """The ports of this instance's ranks exist (a ConfigError naming the keys otherwise)."""
        last = self.rank_port(tp_size - 1, dp_index, tp_size) or self.instance_port(dp_index, tp_size)
        if last > 65535:
            raise ConfigError(
                f"side_channel_port {self.side_channel_port} leaves no room for data-parallel index {dp_index} "
                f"at tensor_parallel_size {tp_size} ({self.side_channel_ports.value} layout: port {last}): "
                "choose a lower side_channel_port"
            )


# Keys users may set in kv_connector_extra_config, with their checker.
_NIXL_BACKENDS = ("UCX",)
MAX_IDLE_WAIT_MS = 100.0  # a new request may wait this long for an idle step to end
DEFAULT_POOL_KIB = 64 * 1024  # staging pool when not set
DEFAULT_CHUNK_KIB = 4096  # staging chunk when not set: this, or pool / 8 for pools under 32 MiB
# With staging "fragmented", Mooncake over TCP moved a shuffled 256 MiB table in 16 KiB blocks 2.1x
# faster through 128 MiB in 16 MiB chunks than directly; through 64 MiB in 4 MiB chunks no faster.
DEFAULT_FRAGMENTED_POOL_KIB = 128 * 1024
DEFAULT_FRAGMENTED_CHUNK_KIB = 16 * 1024


def _positive_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a positive number, got {value!r}")
    return float(value)


def _idle_wait_ms(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_IDLE_WAIT_MS:
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}] must be a number of milliseconds in 0..{MAX_IDLE_WAIT_MS:g}, got {value!r}"
        )
    return float(value)


def _port(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be an integer port in 1..65535, got {value!r}")
    return value


def _non_negative_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a non-negative integer, got {value!r}")
    return value


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a positive integer, got {value!r}")
    return value


def _host(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a host name or IP address, got {value!r}")
    return value


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a string, got {value!r}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")
    return value


def _choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if value not in choices:
            raise ConfigError(f"kv_connector_extra_config[{key!r}] must be one of {', '.join(choices)}; got {value!r}")
        return str(value)

    return check


def _mode(key: str, value: Any) -> TransferMode:
    valid = tuple(m.value for m in TransferMode)
    return TransferMode(_choice(valid)(key, value))


_CHECKERS: dict[str, Callable[[str, Any], Any]] = {
    "side_channel_host": _host,
    "side_channel_port": _port,
    "side_channel_ports": lambda key, value: PortLayout(_choice(tuple(m.value for m in PortLayout))(key, value)),
    "side_channel_bind_host": _host,
    "side_channel_max_msg_kib": _positive_int,
    "side_channel_secret_env": _string,
    "lease_s": _positive_float,
    "lease_renew_after_s": _positive_float,
    "handshake_timeout_s": _positive_float,
    "transfer_timeout_s": _positive_float,
    "settle_timeout_s": _positive_float,
    "mode": _mode,
    "nixl_backend": _choice(_NIXL_BACKENDS),
    "progress_delay_us": _non_negative_int,
    "nixl_num_threads": _non_negative_int,
    "mooncake_protocol": _choice(("tcp", "rdma")),
    "mooncake_device_name": _string,
    "host_huge_pages": _bool,
    "staging": lambda key, value: Staging(_choice(tuple(m.value for m in Staging))(key, value)),
    "staging_pool_kib": _positive_int,
    "staging_chunk_kib": _positive_int,
    "staging_fragment_runs": _positive_int,
    "staging_fragment_kib": _positive_int,
    "layerwise": _bool,
    "idle_wait_ms": _idle_wait_ms,
    "engine_cpus": check_engine_cpus,
    "lease_words": _bool,
}

VALID_KEYS: tuple[str, ...] = tuple(sorted(_CHECKERS))

# Each transport's own defaults for some keys (overridden by kv_connector_extra_config): Mooncake
# pushes. Read by the connector classes and by `kv-connectors check-config`.
TRANSPORT_DEFAULTS: dict[str, dict[str, Any]] = {"nixl": {}, "mooncake": {"mode": "push"}}

# Drop-in for vLLM's built-in NixlConnector: a switching user keeps the launch script and extra
# config that worked there. Its side-channel environment variables are our defaults (our config keys
# still win); its extra-config keys are mapped to ours, or accepted with a warning where they have
# no counterpart here (never silently, never a start-up failure).
BUILTIN_ENV: dict[str, str] = {
    "side_channel_host": "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "side_channel_port": "VLLM_NIXL_SIDE_CHANNEL_PORT",
}
BUILTIN_ALIASES: dict[str, str] = {
    "kv_lease_duration": "lease_s",
    "num_threads": "nixl_num_threads",
    "backends": "nixl_backend",
}
BUILTIN_WITHOUT_EFFECT: dict[str, str] = {
    "enforce_handshake_compat": "the compatibility hash is always checked here",
    "bidirectional_kv_xfer": "set `mode` (pull or push) instead",
    "decoder_kv_blocks_ttl": "D holds no blocks for P here",
    "engine_ttl": "peers are forgotten on disconnect or a new epoch here",
    "kv_recompute_threshold": "a failed load follows vLLM's kv_load_failure_policy",
    "push_registration_timeout": "push requests wait for transfer_timeout_s here",
}


def _from_builtin(extra: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The built-in connector's settings translated to ours (ours win where both are given)."""
    out = dict(extra)
    for ours, env in BUILTIN_ENV.items():
        if ours not in out and environ.get(env, "") != "":
            raw = environ[env]
            try:
                out[ours] = _CHECKERS[ours](ours, int(raw) if ours == "side_channel_port" else raw)
            except (ValueError, ConfigError):
                what = "an integer port in 1..65535" if ours == "side_channel_port" else "a host name or address"
                raise ConfigError(
                    f"environment variable {env} (the built-in connector's {ours}) must be {what}; got {raw!r}"
                ) from None
    for theirs, ours in BUILTIN_ALIASES.items():
        if theirs not in out:
            continue
        value = out.pop(theirs)
        if theirs == "backends":
            if not isinstance(value, (list, tuple)) or len(value) != 1:
                raise ConfigError(f"kv_connector_extra_config['backends'] must name exactly one NIXL backend; got {value!r}")
            value = value[0]
        if ours in out and out[ours] != value:
            raise ConfigError(f"kv_connector_extra_config sets both {theirs!r} (vLLM's name) and {ours!r} to different values")
        out[ours] = value
    for theirs, why in BUILTIN_WITHOUT_EFFECT.items():
        if theirs in out:
            out.pop(theirs)
            logger.warning("kv_connector_extra_config[%r] (vLLM's built-in connector) has no effect: %s", theirs, why)
    return out


def check_parallelism(tensor_parallel_size: int, pipeline_parallel_size: int, connector: str) -> None:
    """Pipeline parallelism is refused at start-up: a stage would read another stage's layers and
    answer with wrong tokens. Tensor parallelism is served rank to rank: each rank hands off its
    own heads, and a peer of another TP size is refused per request (never served wrong)."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp < 1:
        raise ConfigError(f"{connector}: tensor_parallel_size must be >= 1, got {tp}")
    if pp > 1:
        raise ConfigError(
            f"{connector} supports pipeline_parallel_size 1 only (this instance: {pp}): each stage would "
            "need its own slice of the peer's layers, which is not implemented yet. Run prefill and "
            "decode instances with --pipeline-parallel-size 1"
        )


def parse_role(value: Any) -> Role:
    """vLLM's kv_role string as a Role, or a ConfigError naming the valid ones."""
    try:
        return Role(value)
    except ValueError:
        valid = ", ".join(r.value for r in Role)
        raise ConfigError(f"kv_role must be one of {valid}; got {value!r}") from None


def parse_config(
    engine_id: str,
    role: Any,
    extra: Mapping[str, Any] | None,
    defaults: Mapping[str, Any] | None = None,
) -> ConnectorConfig:
    """Build the typed config; unknown keys and bad values raise ConfigError naming the key.

    defaults: a connector's own defaults for some keys (e.g. Mooncake pushes), overridden by extra.
    """
    extra = _from_builtin({**dict(defaults or {}), **dict(extra or {})}, os.environ)
    unknown = sorted(set(extra) - set(_CHECKERS))
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(VALID_KEYS)}"
        )
    values: dict[str, Any] = {key: _CHECKERS[key](key, value) for key, value in extra.items()}
    fragmented = values.get("staging") is Staging.FRAGMENTED
    pool = values.setdefault("staging_pool_kib", DEFAULT_FRAGMENTED_POOL_KIB if fragmented else DEFAULT_POOL_KIB)
    if "staging_chunk_kib" not in values:  # 4 MiB chunks (1.1-1.5x faster than 1 MiB, CPU and H200), 8+ slots
        values["staging_chunk_kib"] = max(1, min(DEFAULT_FRAGMENTED_CHUNK_KIB if fragmented else DEFAULT_CHUNK_KIB, pool // 8))
    chunk = values["staging_chunk_kib"]
    if pool < 2 * chunk:
        raise ConfigError(
            f"kv_connector_extra_config['staging_pool_kib'] ({pool}) must hold at least two chunks of "
            f"staging_chunk_kib ({chunk}) so that chunks can be pipelined"
        )
    if not engine_id:
        raise ConfigError("engine_id must be a non-empty string")
    if values.get("side_channel_secret_env"):
        name = values["side_channel_secret_env"]
        secret = os.environ.get(name, "")
        if not secret:
            raise ConfigError(
                f"kv_connector_extra_config['side_channel_secret_env'] names {name!r}, which is not set "
                "(or empty) in this process's environment: export the shared secret there on every instance"
            )
        values["side_channel_secret"] = secret.encode()
    return ConnectorConfig(engine_id=str(engine_id), role=parse_role(role), **values)
