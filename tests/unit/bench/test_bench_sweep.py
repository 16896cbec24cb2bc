"""bench_transport.py --sweep plumbing: memory fit, sizes, the time-against-size fit (no transports)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.transport.bench_transport import main as transport_main
from benchmarks.transport.sweep import fit, fits, mem_available_bytes, parse_sizes, series_name, summary, table

GiB = 1 << 30


def _point(size_mib: int, ms: float, transport: str = "nixl") -> dict:
    return {
        "transport": transport,
        "mode": "pull",
        "order": "shuffled",
        "staging": False,
        "size_mib": size_mib,
        "bytes": size_mib << 20,
        "descriptors": 8,
        "xfer_ms": ms,
        "gbps": (size_mib << 20) / ms / 1e6,
        "memcpy_ms": ms / 10,
        "ratio": 0.1,
    }


def test_points_that_do_not_fit_memory_are_skipped():
    assert fits(1024, 16 * GiB) is None
    why = fits(1024, 5 * GiB)
    assert why is not None and "needs ~6.0 GiB" in why
    assert fits(1, 3 * GiB) is None


def test_mem_available_is_read_from_meminfo(tmp_path: Path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemAvailable:   2000000 kB\n")
    assert mem_available_bytes(str(f)) == 2000000 * 1024
    f.write_text("MemTotal: 1 kB\n")
    with pytest.raises(RuntimeError):
        mem_available_bytes(str(f))
    assert mem_available_bytes() > 0


def test_sizes_are_sorted_and_checked():
    assert parse_sizes("16,1,4,4") == [1, 4, 16]
    with pytest.raises(SystemExit):
        parse_sizes("0,4")


def test_fit_recovers_fixed_cost_and_bandwidth():
    # 0.5 ms fixed + 1 GB/s: 1 MiB -> 0.5 + 1.048576 ms
    pts = [_point(s, 0.5 + (s << 20) / 1e6) for s in (1, 4, 16, 64)]
    f = fit(pts)
    assert f == {"fixed_ms": pytest.approx(0.5, abs=1e-3), "marginal_gbps": pytest.approx(1.0, abs=1e-3)}
    assert fit(pts[:1]) is None
    growth = summary(pts + [_point(1, 7.0, "mooncake"), _point(4, 9.0, "mooncake")])
    assert set(growth) == {"nixl pull shuffled", "mooncake pull shuffled"}
    assert growth["nixl pull shuffled"]["size_growth"] == 64
    assert growth["mooncake pull shuffled"]["time_growth"] == pytest.approx(9 / 7, abs=0.1)
    assert series_name({**pts[0], "staging": True}) == "nixl pull shuffled staging"
    assert series_name({**pts[0], "staging": True, "staging_mode": "fragmented"}) == "nixl pull shuffled staging fragmented"
    assert series_name({**pts[0], "staging": False, "staging_mode": "off"}) == "nixl pull shuffled"
    assert "nixl pull shuffled" in table(pts)


def test_lists_without_sweep_are_refused():
    with pytest.raises(SystemExit):
        transport_main(["--transport", "nixl,mooncake"])
    with pytest.raises(SystemExit):
        transport_main(["--transport", "rdma"])
    with pytest.raises(SystemExit):
        transport_main(["--plot", "x.png"])
