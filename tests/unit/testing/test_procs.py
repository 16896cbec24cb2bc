"""kvc_testing.procs: children outlive the thread that started them (PDEATHSIG is per thread), and
stop_process returns only once the process is stopped; running() starts servers side by side."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from kvc_testing.procs import ManagedProcess, VllmServer, free_port, is_stopped, running, stop_all, stop_process

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_child_started_from_a_thread_that_ends_keeps_running():
    """A fault thread restarts a server and ends: the server must live on (it did not: PR_SET_PDEATHSIG
    fires when the thread that forked the child exits, and the restarted D was SIGTERMed at once)."""
    proc = ManagedProcess(SLEEPER, name="sleeper-from-thread")
    thread = threading.Thread(target=proc.start)
    thread.start()
    thread.join(10)
    try:
        time.sleep(1.0)
        assert proc.is_running(), f"the child died with the thread that started it (rc={proc.returncode})"
    finally:
        proc.stop()
    assert not proc.is_running()


def test_stop_process_returns_once_every_thread_is_stopped():
    import os
    import signal

    with ManagedProcess(SLEEPER, name="sleeper-stopped") as proc:
        assert proc.pid is not None
        stop_process(proc.pid)
        assert is_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while is_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_stopped(proc.pid)


# A stand-in for a vLLM server: answers GET /health with 200 once `delay` seconds have passed since it
# started, and records the moment it started (time.time) in its log; with a delay < 0 it exits at once.
_HEALTH_AFTER = """
import http.server, sys, time
print('started', time.time(), flush=True)
delay = float(sys.argv[2])
if delay < 0:
    raise SystemExit(5)
time.sleep(delay)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


def _stand_in(name: str, delay: float, tmp_path: Path) -> VllmServer:
    server = VllmServer("unused", port=free_port(), name=name, log_path=tmp_path / f"{name}.log")
    server.argv = [sys.executable, "-c", _HEALTH_AFTER, str(server.port), str(delay)]
    return server


def _started_at(server: VllmServer) -> float:
    return float(server.log_tail(5).split("started", 1)[1].split()[0])


def test_running_starts_every_server_before_waiting_and_stops_them_all(tmp_path: Path) -> None:
    a, b, c = (_stand_in(n, 1.5, tmp_path) for n in "abc")
    t0 = time.monotonic()
    with running(a, b, c) as servers:
        elapsed = time.monotonic() - t0
        assert servers == (a, b, c)
        assert all(s.is_running() for s in servers)
        starts = [_started_at(s) for s in servers]
        # one after the other they would take 4.5 s; all were started before the first was ready
        assert max(starts) - min(starts) < 1.5, starts
        assert elapsed < 4.0, elapsed
    assert not any(s.group_alive() for s in (a, b, c))


def test_running_stops_the_others_when_one_fails_to_start(tmp_path: Path) -> None:
    good, bad = _stand_in("good", 0.2, tmp_path), _stand_in("bad", -1, tmp_path)
    with pytest.raises(RuntimeError, match="bad exited with code 5"):
        with running(good, bad):
            raise AssertionError("unreachable: bad never became ready")
    assert not good.group_alive() and not bad.group_alive()


def test_stop_all_shuts_groups_down_side_by_side(tmp_path: Path) -> None:
    # each ignores SIGTERM for 1 s after it arrives: one after the other 3 s, side by side about 1
    script = "import signal, time\nsignal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), exit(0)))\ntime.sleep(60)"
    procs = [ManagedProcess([sys.executable, "-c", script], name=f"stop-{i}", log_path=tmp_path / f"{i}.log") for i in range(3)]
    for proc in procs:
        proc.start()
    time.sleep(0.5)  # the handlers are installed
    t0 = time.monotonic()
    stop_all(procs)
    assert time.monotonic() - t0 < 2.5
    assert [proc.returncode for proc in procs] == [0, 0, 0]


def test_ready_cpus_pins_every_thread_of_the_group_once_ready_not_before(tmp_path: Path) -> None:
    """A TP server's start-up runs on every core; once ready, its API server, engine and workers (each
    with threads) run on its cores only."""
    import os

    allowed = os.sched_getaffinity(0)
    server = _stand_in("pinned", 0.5, tmp_path)
    server.ready_cpus = {min(allowed)}
    # the stand-in starts a child (a worker: same process group) and a thread of its own first
    spawn = """
import os, subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("affinity", sorted(os.sched_getaffinity(0)), flush=True)
"""
    server.argv[2] = spawn + "\n" + _HEALTH_AFTER
    with running(server):
        assert f"affinity {sorted(allowed)}" in server.log_tail(5), "pinned before it was ready"
        pids = server.group_pids()
        assert len(pids) >= 2, pids
        threads = {(pid, int(t)) for pid in pids for t in os.listdir(f"/proc/{pid}/task")}
        assert len(threads) >= 3, threads
        assert {tid: os.sched_getaffinity(tid) for _, tid in threads} == {tid: {min(allowed)} for _, tid in threads}


def test_a_cpu_list_reads_as_taskset_reads_it() -> None:
    from kvc_testing.procs import _cpu_list

    assert _cpu_list("0") == {0} and _cpu_list("0,2") == {0, 2} and _cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    for bad in ("", "a", "1-x"):
        with pytest.raises(ValueError, match="not a CPU list"):
            _cpu_list(bad)
