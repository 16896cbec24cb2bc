"""kvc_testing.procs: children outlive the thread that started them (PDEATHSIG is per thread), and
stop_process returns only once the process is stopped."""

from __future__ import annotations

import sys
import threading
import time

from kvc_testing.procs import ManagedProcess, is_stopped, stop_process

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
