"""`make test`'s runner: each test tier in its own pytest run, in order, then one line per tier (tests,
outcome, minutes) and the total; exit 1 if any tier failed. Every tier runs even after a failure, so
one run shows them all.

    python -m kvc_testing.tiers [--only unit,e2e] [--e2e-workers N] [-- PYTEST_ARGS...]

--e2e-workers N > 1 runs the end-to-end tier's modules N at a time (pytest-xdist, a module to a worker:
a module's servers stay together). Those tests mostly wait on one single-threaded server at a time:
on a 2-core host one such run kept the CPUs about half busy.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

# (name, test folder): fast first, so that a broken build shows in minutes.
TIERS: tuple[tuple[str, str], ...] = (
    ("unit", "tests/unit"),
    ("contract", "tests/contract"),
    ("transports", "tests/transports"),
    ("e2e", "tests/e2e"),
)
_SUMMARY = re.compile(r"=+ (.*) in [\d.]+s")
NO_TESTS = 5  # pytest's exit code when it collected nothing


@dataclass(frozen=True)
class TierResult:
    name: str
    returncode: int
    seconds: float
    summary: str  # pytest's last line: "1186 passed, 19 warnings" (or what it printed instead)

    @property
    def ok(self) -> bool:
        return self.returncode in (0, NO_TESTS)  # -k or -m may leave a tier nothing to run

    def line(self) -> str:
        mark = "ok" if self.ok else f"FAILED (exit {self.returncode})"
        return f"{self.name:<11} {self.seconds / 60:6.1f} min  {mark:<18} {self.summary}"


def summary_of(output: str) -> str:
    """pytest's closing summary ("N passed, M failed ... in Xs" without the time), or its last line."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    for line in reversed(lines):
        match = _SUMMARY.search(line) or re.match(r"^(\d+ (?:passed|failed|error).*) in [\d.]+s", line)
        if match:
            return match.group(1).strip()
    return lines[-1].strip() if lines else "no output"


def tier_args(name: str, pytest_args: Sequence[str], e2e_workers: int) -> list[str]:
    """A tier's pytest arguments: the e2e tier's modules spread over workers where asked."""
    if name == "e2e" and e2e_workers > 1:
        return ["-n", str(e2e_workers), "--dist", "loadfile", *pytest_args]
    return list(pytest_args)


def run_tier(name: str, path: str, pytest_args: Sequence[str]) -> TierResult:
    """One tier's pytest run, its output streamed through as it comes (and kept for the summary)."""
    print(f"\n=== tier {name}: pytest {path} ===", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *pytest_args, path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        sys.stdout.write(line)
        tail = (tail + [line])[-50:]
    returncode = proc.wait()
    return TierResult(name, returncode, time.monotonic() - start, summary_of("".join(tail)))


def report(results: Sequence[TierResult]) -> str:
    total = sum(r.seconds for r in results)
    rows = [r.line() for r in results]
    return "\n".join(["", "=== test tiers ===", *rows, f"{'total':<11} {total / 60:6.1f} min"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the test tiers one after another and time each.")
    parser.add_argument("--only", default="", help="comma-separated tier names (default: all): " + ", ".join(n for n, _ in TIERS))
    parser.add_argument("--e2e-workers", type=int, default=1, help="end-to-end modules run at a time (pytest-xdist)")
    parser.add_argument("pytest_args", nargs="*", help="passed to every pytest run (after --)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or [n for n, _ in TIERS]
    unknown = set(names) - {n for n, _ in TIERS}
    if unknown:
        parser.error(f"unknown tier(s) {sorted(unknown)}; known: {[n for n, _ in TIERS]}")
    results = [run_tier(name, path, tier_args(name, args.pytest_args, args.e2e_workers)) for name, path in TIERS if name in names]
    print(report(results), flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
