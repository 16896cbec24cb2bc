"""Wire format (round trip, version and hash checks), config parsing and params parsing."""

import msgspec
import pytest

from kv_connectors import wire
from kv_connectors.config import VALID_KEYS, Role, TransferMode, parse_config
from kv_connectors.errors import ConfigError, HandshakeError, IncompatiblePeerError, TransferParamsError
from kv_connectors.layout import Cells, KVLayout, Part, Region
from kv_connectors.params import parse_remote_prefill, producer_params
from tests.unit.core.wire_samples import COMPAT


def test_round_trip_every_message():
    layout = KVLayout(8, 32, (Region(4096, 512, 512, 8), Region(1 << 40, 1024, 512, 8)))
    msgs = [
        wire.HandshakeRequest("d-engine", 0, COMPAT),
        wire.HandshakeReply("p", "agent", b"\x00\x01meta", wire.LayoutMsg.from_layout(layout)),
        wire.StatsRequest(),
        wire.StatsReply(engine_id="p", held_requests=1, held_blocks=2, completed_sends=3, expired_leases=4, recv_bytes=5),
        wire.ErrorReply("incompatible", "x"),
        wire.TransferDone("req-1", "d"),
    ]
    for m in msgs:
        assert wire.decode(wire.encode(m, COMPAT.hash()), COMPAT.hash()) == m
    back = msgs[1].layout.to_layout()
    assert back == layout


def test_cells_travel_with_the_layout_and_are_checked():
    k, v = Part(0, 2, 64, 4, 4), Part(128, 1, 0, 8, 8)  # K transposed (2 rows of a 4-byte element), V by token
    cells = Cells(heads=2, head_stride=256, tokens=16, parts=(k, v), first_head=2)
    layout = KVLayout(8, 16, (Region(4096, 512, 512, 8),), cells)
    msg = wire.LayoutMsg.from_layout(layout)
    assert wire.decode(wire.encode(wire.HandshakeReply("p", "a", b"", msg), "h"), "h").layout.to_layout() == layout
    part = msg.cells.parts[1]
    for bad in (
        {"parts": [msgspec.structs.replace(part, cell_bytes=400)]},  # the last cell would end past the 512-byte segment
        {"tokens": 32},  # not the advertised block size
        {"first_head": 2**62},
        {"heads": 0},
        {"parts": [msgspec.structs.replace(part, token_stride=-8)]},
        {"parts": [msgspec.structs.replace(part, rows=2**40)]},
        {"parts": []},
    ):
        forged = msgspec.structs.replace(msg, cells=msgspec.structs.replace(msg.cells, **bad))
        with pytest.raises(HandshakeError, match="invalid KV cells"):
            forged.to_layout()


def test_hash_mismatch_is_refused_before_the_body():
    other = msgspec.structs.replace(COMPAT, num_layers=8)
    assert other.hash() != COMPAT.hash()
    frame = wire.encode(wire.TransferDone("r", "e"), other.hash())
    with pytest.raises(IncompatiblePeerError, match="compatibility hash"):
        wire.decode(frame, COMPAT.hash())
    assert "num_layers: ours=2 peer=8" in COMPAT.diff(other)


def test_wire_version_mismatch():
    frame = msgspec.msgpack.encode((wire.Header(wire.WIRE_VERSION + 1, COMPAT.hash(), "done"), {"x": 1}))
    with pytest.raises(IncompatiblePeerError, match="wire version"):
        wire.decode(frame, COMPAT.hash())


def test_garbage_and_mismatched_kind():
    with pytest.raises(HandshakeError):
        wire.decode(b"\xff\x00garbage", None)
    frame = msgspec.msgpack.encode((wire.Header(wire.WIRE_VERSION, "h", "stats"), wire.TransferDone("r", "e")))
    with pytest.raises(HandshakeError, match="does not match"):
        wire.decode(frame, None)


def test_compat_hash_ignores_nothing_it_covers():
    for field, value in [("dtype", "torch.bfloat16"), ("block_size", 64), ("num_kv_heads", 4), ("layout", (1,))]:
        assert msgspec.structs.replace(COMPAT, **{field: value}).hash() != COMPAT.hash()


def test_config_defaults_and_values():
    cfg = parse_config("e1", "kv_producer", {"side_channel_port": 6000, "lease_s": 2})
    assert cfg.role is Role.PRODUCER and cfg.side_channel_port == 6000 and cfg.lease_s == 2.0
    assert cfg.mode is TransferMode.PULL and cfg.side_channel_host == "127.0.0.1"
    assert parse_config("e", "kv_consumer", None).role.consumes


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"sidechannel_port": 1}, "unknown kv_connector_extra_config key.*sidechannel_port.*valid keys"),
        ({"side_channel_port": 0}, "side_channel_port"),
        ({"side_channel_port": "5600"}, "side_channel_port"),
        ({"lease_s": -1}, "lease_s.*positive"),
        ({"lease_s": True}, "lease_s"),
        ({"mode": "teleport"}, "mode.*pull"),
        ({"nixl_backend": "GDS"}, "nixl_backend.*UCX"),
        ({"progress_delay_us": -5}, "progress_delay_us"),
        ({"side_channel_host": ""}, "side_channel_host"),
        ({"idle_wait_ms": -1}, "idle_wait_ms.*0..100"),
        ({"idle_wait_ms": 1e9}, "idle_wait_ms.*0..100"),
        ({"idle_wait_ms": float("nan")}, "idle_wait_ms"),
    ],
)
def test_config_errors_name_the_key(extra, match):
    with pytest.raises(ConfigError, match=match):
        parse_config("e", "kv_producer", extra)


def test_bad_role():
    with pytest.raises(ConfigError, match="kv_role must be one of"):
        parse_config("e", "prefill", {})
    assert "lease_s" in VALID_KEYS


def test_params_round_trip_and_errors():
    good = producer_params(block_ids=[3, 4], engine_id="p", request_id="r", host="127.0.0.1", port=5710, num_tokens=40)
    rp = parse_remote_prefill(good)
    assert rp.remote_block_ids == (3, 4) and rp.peer_key == ("p", "127.0.0.1", 5710)
    bad_cases = [
        ({**good, "remote_block_ids": "3,4"}, "remote_block_ids"),
        ({**good, "remote_block_ids": []}, "remote_block_ids"),
        ({**good, "remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({**good, "remote_port": "5710"}, "remote_port"),
        ({k: v for k, v in good.items() if k != "remote_engine_id"}, "lacks remote_engine_id"),
        ({**good, "remote_num_tokens": 0}, "remote_num_tokens"),
    ]
    for params, match in bad_cases:
        with pytest.raises(TransferParamsError, match=match):
            parse_remote_prefill(params)


def test_transfer_id_form_of_params():
    """The transfer-id flow: D knows only P's side channel and the id both requests carry."""
    rp = parse_remote_prefill({"do_remote_prefill": True, "transfer_id": "t1", "remote_host": "h", "remote_port": 9})
    assert rp.push_only and rp.remote_block_ids == () and rp.remote_request_id == "t1"
    assert rp.peer_key == ("", "h", 9)
    rp = parse_remote_prefill({"transfer_id": "t1", "remote_host": "h", "remote_port": 9, "remote_engine_id": "P"})
    assert rp.peer_key == ("P", "h", 9)
    for bad, match in (
        ({"transfer_id": "t1", "remote_port": 9}, "lacks remote_host"),
        ({"transfer_id": 7, "remote_host": "h", "remote_port": 9}, "transfer_id"),
        ({"transfer_id": "t", "remote_host": "h", "remote_port": 0}, "remote_port"),
    ):
        with pytest.raises(TransferParamsError, match=match):
            parse_remote_prefill(bad)
    # P's answer to a request with a transfer id names the blocks by that id, for either flow.
    params = producer_params(block_ids=[1, 2], engine_id="P", request_id="r", host="h", port=9, num_tokens=40, transfer_id="t1")
    rp = parse_remote_prefill(params)
    assert not rp.push_only and rp.remote_request_id == "t1" and rp.transfer_id == "t1"


def test_staging_config():
    from kv_connectors.config import Staging

    cfg = parse_config("e", "kv_consumer", {"staging": "on", "staging_pool_kib": 128, "staging_chunk_kib": 32})
    assert cfg.staging is Staging.ON and cfg.staging_pool_kib == 128
    assert parse_config("e", "kv_consumer", {}).staging is Staging.AUTO
    with pytest.raises(ConfigError, match="staging.*auto, on, off"):
        parse_config("e", "kv_consumer", {"staging": True})
    with pytest.raises(ConfigError, match="at least two chunks"):
        parse_config("e", "kv_consumer", {"staging_pool_kib": 64, "staging_chunk_kib": 64})
    # Unset, the chunk is 4 MiB, or an eighth of a smaller pool (a small pool still pipelines).
    assert parse_config("e", "kv_consumer", {}).staging_chunk_kib == 4096
    assert parse_config("e", "kv_consumer", {"staging_pool_kib": 8192}).staging_chunk_kib == 1024
    assert parse_config("e", "kv_consumer", {"staging_pool_kib": 4}).staging_chunk_kib == 1
    assert parse_config("e", "kv_consumer", {"staging_pool_kib": 8192, "staging_chunk_kib": 4096}).staging_chunk_kib == 4096


def test_connector_defaults_yield_to_user_config():
    cfg = parse_config("e", "kv_consumer", {}, defaults={"mode": "push"})
    assert cfg.mode is TransferMode.PUSH
    cfg = parse_config("e", "kv_consumer", {"mode": "pull"}, defaults={"mode": "push"})
    assert cfg.mode is TransferMode.PULL


def test_compat_hash_covers_the_way_data_moves():
    staged = msgspec.structs.replace(COMPAT, transport="nixl+staging")
    assert staged.hash() != msgspec.structs.replace(COMPAT, transport="nixl").hash()


def test_bad_params_still_name_where_to_release():
    from kv_connectors.params import release_address

    good = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 9,
        "remote_block_ids": [1.5],
    }
    with pytest.raises(TransferParamsError, match="remote_block_ids"):
        parse_remote_prefill(good)
    rp = release_address(good)
    assert rp is not None and rp.peer_key == ("P", "h", 9) and rp.remote_request_id == "r" and rp.push_only
    assert release_address({**good, "remote_port": 70000}) is None
    assert release_address({**good, "remote_request_id": 7}) is None
    assert release_address("nope") is None
    with pytest.raises(TransferParamsError, match="1..65535"):
        parse_remote_prefill({**good, "remote_block_ids": [1], "remote_port": 70000})


def test_request_params_parsed_once_into_a_record():
    from kv_connectors.params import NO_PARAMS, parse_request_params

    assert parse_request_params(None) is NO_PARAMS and parse_request_params({}) is NO_PARAMS
    assert parse_request_params("nope") is NO_PARAMS
    d = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r", "remote_host": "h", "remote_port": 9}
    good = parse_request_params({**d, "remote_block_ids": [1, 2], "remote_num_tokens": 40})
    assert good.remote_prefill and not good.remote_decode and good.prefill_error is None and good.release is None
    assert good.prefill is not None and good.prefill.remote_block_ids == (1, 2) and good.prefill.peer_key == ("P", "h", 9)
    bad = parse_request_params({**d, "remote_block_ids": [1.5]})
    assert bad.prefill is None and isinstance(bad.prefill_error, TransferParamsError)
    assert bad.release is not None and bad.release.remote_request_id == "r"
    p = parse_request_params({"do_remote_decode": True, "transfer_id": "t"})
    assert p.remote_decode and not p.remote_prefill and p.transfer_id == "t" and p.transfer_id_error is None
    p = parse_request_params({"do_remote_decode": True, "transfer_id": 7})
    assert p.transfer_id is None and isinstance(p.transfer_id_error, TransferParamsError)
    assert not parse_request_params({"do_remote_decode": "yes", "do_remote_prefill": 1}).remote_decode


class _OldErrorReply(msgspec.Struct, frozen=True, tag="error"):
    """ErrorReply as peers before ErrorCode declared it: the code a plain string."""

    code: str
    message: str


def test_error_codes_keep_their_wire_encoding():
    old_frames = msgspec.msgpack.Decoder(tuple[wire.Header, _OldErrorReply])
    for code in wire.ErrorCode:
        # ours, read by an old peer: the same string
        _header, old = old_frames.decode(wire.encode(wire.ErrorReply(code, "m"), COMPAT.hash()))
        assert type(old.code) is str and old.code == code.value
        # an old peer's, read by us: the enum member
        frame = msgspec.msgpack.encode((wire.Header(wire.WIRE_VERSION, COMPAT.hash(), "error"), _OldErrorReply(code.value, "m")))
        reply = wire.decode(frame, COMPAT.hash())
        assert isinstance(reply, wire.ErrorReply) and reply.code is code
    assert {c.value for c in wire.ErrorCode} == {"incompatible", "bad_request", "not_ready", "unauthenticated", "internal"}
    # a code we do not know is a malformed answer (a HandshakeError, as any refusal is to the caller)
    frame = msgspec.msgpack.encode((wire.Header(wire.WIRE_VERSION, COMPAT.hash(), "error"), _OldErrorReply("novel", "m")))
    with pytest.raises(HandshakeError, match="malformed"):
        wire.decode(frame, COMPAT.hash())


def test_fragmented_staging_config():
    """fragmented: a larger pool in larger chunks unless set (the measured win needs them), and its two knobs."""
    from kv_connectors.config import Staging

    cfg = parse_config("e", "kv_consumer", {"staging": "fragmented"})
    assert cfg.staging is Staging.FRAGMENTED
    assert (cfg.staging_pool_kib, cfg.staging_chunk_kib) == (128 * 1024, 16 * 1024)
    assert (cfg.staging_fragment_runs, cfg.staging_fragment_kib) == (256, 64)
    assert parse_config("e", "kv_consumer", {"staging": "fragmented", "staging_pool_kib": 8192}).staging_chunk_kib == 1024
    cfg = parse_config("e", "kv_consumer", {"staging": "fragmented", "staging_fragment_runs": 8, "staging_fragment_kib": 16})
    assert (cfg.staging_fragment_runs, cfg.staging_fragment_kib) == (8, 16)
    assert parse_config("e", "kv_consumer", {"staging": "on"}).staging_pool_kib == 64 * 1024, "other modes keep their pool"
    with pytest.raises(ConfigError, match="staging_fragment_runs"):
        parse_config("e", "kv_consumer", {"staging": "fragmented", "staging_fragment_runs": 0})
