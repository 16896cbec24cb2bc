"""bench_first_request's pure parts: the shapes it takes, its verdict on a pair, the log lines it quotes."""

from __future__ import annotations

import pytest

from benchmarks.faults import bench_first_request as bench


def test_shapes_default_to_all_and_unknown_ones_are_refused():
    assert bench.parse_shapes("") == list(bench.SHAPES)
    assert bench.parse_shapes("p-block32-to-d-block64-pull") == ["p-block32-to-d-block64-pull"]
    with pytest.raises(ValueError, match="unknown shape"):
        bench.parse_shapes("p-tp8")


def _row(exact=(True, True), loaded=True, loads=2):
    return {"requests": [{"exact": e} for e in exact], "host_loaded": loaded, "d_loads": loads}


@pytest.mark.parametrize(
    ("row", "ok"),
    [(_row(), True), (_row(exact=(False, True)), False), (_row(loaded=False), False), (_row(loads=1), False)],
    ids=["exact", "a-wrong-answer", "host-not-loaded", "d-computed-one"],
)
def test_a_pair_passes_only_with_both_answers_exact_on_a_loaded_host_and_both_loaded(row, ok):
    assert bench.verdict(row) is ok


def test_log_lines_are_the_handshakes_loads_and_pushes(tmp_path):
    class Server:
        log_path = tmp_path / "d.log"

    Server.log_path.write_text("noise\nconnected to producer X\nkv load request r1 ms=3\nkv push request r2\nmore\n")
    assert bench.log_lines(Server()) == ["connected to producer X", "kv load request r1 ms=3", "kv push request r2"]
