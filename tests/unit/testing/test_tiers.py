"""`make test`'s tier runner (kvc_testing.tiers): every tier runs and is timed, a failed one fails the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvc_testing import tiers


def test_summary_is_pytests_closing_line_without_its_time():
    assert tiers.summary_of("....\n1186 passed, 19 warnings in 80.42s (0:01:20)\n") == "1186 passed, 19 warnings"
    assert tiers.summary_of("F.\n===== 1 failed, 1 passed in 0.12s =====\n") == "1 failed, 1 passed"
    assert tiers.summary_of("ERROR: file or directory not found: x\n\n") == "ERROR: file or directory not found: x"
    assert tiers.summary_of("") == "no output"


def test_report_names_each_tier_its_minutes_and_outcome():
    text = tiers.report([tiers.TierResult("unit", 0, 90.0, "10 passed"), tiers.TierResult("e2e", 1, 600.0, "1 failed")])
    lines = text.strip().splitlines()
    assert lines[0] == "=== test tiers ==="
    assert lines[1].split()[:4] == ["unit", "1.5", "min", "ok"]
    assert lines[2].split()[:5] == ["e2e", "10.0", "min", "FAILED", "(exit"]
    assert lines[3].split() == ["total", "11.5", "min"]


def _tier_dir(root: Path, name: str, body: str) -> str:
    """A folder holding one test file: a tier."""
    (root / name).mkdir()
    (root / name / "test_x.py").write_text(body)
    return str(root / name)


def test_every_tier_runs_after_a_failure_and_the_run_fails(tmp_path, monkeypatch, capsys):
    good = _tier_dir(tmp_path, "good", "def test_a():\n    pass\n")
    bad = _tier_dir(tmp_path, "bad", "def test_b():\n    assert False\n")
    monkeypatch.setattr(tiers, "TIERS", (("first", bad), ("second", good)))
    assert tiers.main(["--", "-q", "-p", "no:cacheprovider"]) == 1
    out = capsys.readouterr().out
    assert "=== tier second" in out, "the tier after a failed one did not run"
    assert "first" in out and "FAILED (exit 1)" in out and "1 passed" in out


def test_a_tier_left_nothing_by_a_filter_is_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(tiers, "TIERS", (("only", _tier_dir(tmp_path, "t", "def test_a():\n    pass\n")),))
    assert tiers.main(["--", "-q", "-p", "no:cacheprovider", "-k", "nothing_matches"]) == 0


def test_an_unknown_tier_is_refused():
    with pytest.raises(SystemExit):
        tiers.main(["--only", "nope"])


def test_only_the_e2e_tier_spreads_its_modules_over_workers():
    assert tiers.tier_args("e2e", ["-q"], 2) == ["-n", "2", "--dist", "loadfile", "-q"]
    assert tiers.tier_args("e2e", ["-q"], 1) == ["-q"]
    assert tiers.tier_args("unit", ["-q"], 4) == ["-q"]
