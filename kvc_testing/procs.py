"""Child-process helpers for tests, demo and benchmarks: ports, process groups, vLLM servers."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

logger = logging.getLogger(__name__)

MiB = 1 << 20
_PR_SET_PDEATHSIG = 1

_live: set[ManagedProcess] = set()
_started: list[ManagedProcess] = []
_live_lock = threading.Lock()
_atexit_registered = False


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 when asked, outside the kernel's ephemeral range."""
    return free_ports(1)[0]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_ports = random.Random()
# Every port handed out by this process: nothing binds a port between the draw and the child's
# start, so two draws for two servers of one plan could name the same free port.
_handed: set[int] = set()
_handed_lock = threading.Lock()


LOWEST_PORT = 10_000


def port_span(span: int = 1) -> tuple[int, int]:
    """The ports this process draws from, [low, high] (a first port of `span` consecutive ones): below
    the kernel's ephemeral range, and where pytest-xdist runs workers side by side, worker k's own
    k-th share of it (PYTEST_XDIST_WORKER gwK of PYTEST_XDIST_WORKER_COUNT): two workers never hand
    out one port between one's check and its child's bind."""
    low, high = LOWEST_PORT, _ephemeral_low() - 1
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        k, share = int(worker[2:]) % int(count), (high - low + 1) // int(count)
        low, high = low + k * share, low + (k + 1) * share - 1
    return low, high - (span - 1)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now and never handed out by this process before, drawn
    below the kernel's ephemeral range: a port the kernel hands out (bind to port 0, outgoing
    connections, engines' own listeners) can then never take one between this check and the
    child's bind (that race failed a server start). Under pytest-xdist, from this worker's share."""
    low, high = port_span()
    out: list[int] = []
    with _handed_lock:
        for _ in range(10_000):
            if len(out) == n:
                _handed.update(out)
                return out
            port = _ports.randint(low, high)
            if port in out or port in _handed or not _bindable(port):
                continue
            out.append(port)
    raise RuntimeError(f"no {n} free ports in {low}..{high}")


def free_port_range(n: int) -> int:
    """The first of `n` consecutive ports free on 127.0.0.1 now (a data-parallel instance's side
    channels: base port + DP index; or every rank's in the rank layout), below the kernel's
    ephemeral range like free_ports."""
    low, high = port_span(n)
    with _handed_lock:
        for _ in range(10_000):
            base = _ports.randint(low, high)
            ports = range(base, base + n)
            if _handed.isdisjoint(ports) and all(_bindable(p) for p in ports):
                _handed.update(ports)
                return base
    raise RuntimeError(f"no {n} consecutive free ports in {low}..{high + n - 1}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def is_stopped(pid: int) -> bool:
    """Every thread of pid is stopped (state T or t in /proc): a SIGSTOP has taken effect."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks]
    except OSError:
        return False
    return bool(states) and all(state in ("T", "t") for state in states)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP pid and return once it has taken effect (the signal is delivered asynchronously: a busy
    host may run the process on for a while after kill() returns)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not is_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout:g} s of SIGSTOP")
        time.sleep(0.002)


def _set_parent_death_signal() -> None:
    """preexec_fn: SIGTERM the child when the (starting thread of the) parent dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


_spawner_lock = threading.Lock()
_spawner_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _spawner() -> concurrent.futures.ThreadPoolExecutor:
    """One thread that lives as long as this interpreter, to fork the children other threads start:
    PR_SET_PDEATHSIG fires when the forking *thread* exits, so a child started from a short-lived
    thread (a fault thread restarting a server) would be SIGTERMed as soon as that thread ended."""
    global _spawner_pool
    with _spawner_lock:
        if _spawner_pool is None:
            _spawner_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-spawner")
        return _spawner_pool


def started_processes() -> list[ManagedProcess]:
    """Every ManagedProcess this interpreter started (for leak checks)."""
    with _live_lock:
        return list(_started)


def _cleanup_all() -> None:
    with _live_lock:
        procs = list(_live)
    for p in procs:
        try:
            p.stop(timeout=5.0)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            logger.exception("atexit: failed to stop %s", p.name)


def _track(p: ManagedProcess, alive: bool) -> None:
    global _atexit_registered
    with _live_lock:
        if alive:
            _live.add(p)
            _started.append(p)
            if not _atexit_registered:
                atexit.register(_cleanup_all)
                _atexit_registered = True
        else:
            _live.discard(p)


class ManagedProcess:
    """A child started in its own process group with output to a log file; stop() kills the group.

    With die_with_parent the direct child also gets SIGTERM if this interpreter dies (Linux PDEATHSIG,
    which follows the forking thread: children started off the main thread are forked by one
    long-lived spawner thread, so they outlive the thread that asked).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log_path: str | Path | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.name = name or Path(self.argv[0]).name
        self.env = dict(env) if env is not None else None
        self.cwd = str(cwd) if cwd is not None else None
        self._log_path = Path(log_path) if log_path is not None else None
        self.die_with_parent = die_with_parent
        self._popen: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None
        self._terminated = False  # SIGTERM sent to this start's group (terminate() or stop())

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"kvc-{self.name}-", suffix=".log")
            os.close(fd)
            self._log_path = Path(path)
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll() if self._popen is not None else None

    def is_running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def start(self) -> ManagedProcess:
        if self._popen is not None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.die_with_parent and threading.current_thread() is not threading.main_thread():
            self._popen = _spawner().submit(self._popen_now).result()  # forked by a thread that outlives this one
        else:
            self._popen = self._popen_now()
        self.pgid = self._popen.pid  # session leader == group leader
        self._terminated = False
        _track(self, True)
        logger.info("started %s pid=%d log=%s", self.name, self._popen.pid, self.log_path)
        return self

    def _popen_now(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal if self.die_with_parent else None,
            )

    def log_tail(self, n: int = 40) -> str:
        """Last `n` lines of the log (empty if none yet)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 256 * n))
                data = f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(data.splitlines()[-n:])

    def wait_log(self, text: str, timeout: float) -> None:
        """Wait until the log holds `text` (a child's log is written as it runs); AssertionError
        with the log tail at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(self.log_path, "rb") as f:
                    if text in f.read().decode("utf-8", errors="replace"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}'s log has no {text!r} after {timeout:g} s:\n{self.log_tail(40)}")
            time.sleep(0.2)

    def group_alive(self) -> bool:
        """Whether any process of the group is left (reaps our own child first)."""
        if self.pgid is None:
            return False
        if self._popen is not None:
            self._popen.poll()  # a zombie leader still counts as a group member
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def group_pids(self) -> list[int]:
        """Pids in the process group (from /proc)."""
        pids: list[int] = []
        if self.pgid is None:
            return pids
        for pid in (int(e) for e in os.listdir("/proc") if e.isdigit()):
            try:
                if os.getpgid(pid) == self.pgid:
                    pids.append(pid)
            except OSError:
                continue
        return pids

    def group_cpu_seconds(self) -> float:
        """CPU time (user + system) the group's live processes have used so far."""
        ticks = 0
        for pid in self.group_pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, IndexError, ValueError):
                continue
        return ticks / os.sysconf("SC_CLK_TCK")

    def group_rss_bytes(self) -> int:
        """Sum of resident memory of the group's processes."""
        total = 0
        for pid in self.group_pids():
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
        return total * os.sysconf("SC_PAGE_SIZE")

    def _wait_group(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.group_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def terminate(self) -> None:
        """SIGTERM the whole group without waiting for it (stop() waits, and sends it only once)."""
        if self.pgid is None or self._terminated or not self.group_alive():
            return
        logger.info("stopping %s (pgid %d)", self.name, self.pgid)
        self._terminated = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the whole group, wait `timeout`, then SIGKILL it; returns the exit code."""
        if self._popen is None or self.pgid is None:
            return None
        try:
            if self.group_alive():
                self.terminate()
                if not self._wait_group(timeout):
                    logger.warning("%s ignored SIGTERM for %.0fs; SIGKILL", self.name, timeout)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.pgid, signal.SIGKILL)
                    # orphans are reaped by init, which may take a moment
                    if not self._wait_group(10.0):
                        logger.error("process group %d still alive after SIGKILL", self.pgid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=5.0)
        finally:
            _track(self, False)
        return self._popen.returncode

    def restart(self) -> ManagedProcess:
        """Stop the whole group, then start the same command line again (same ports, same log)."""
        self.stop()
        self._popen, self.pgid = None, None
        return self.start()

    def __enter__(self) -> ManagedProcess:
        if self._popen is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


_P = TypeVar("_P", bound=ManagedProcess)


def group_cores(
    processes: Sequence[ManagedProcess],
    seconds: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[float]:
    """The cores each process group used over the same next `seconds` (1.0: one core busy throughout)."""
    before = [p.group_cpu_seconds() for p in processes]
    t0 = clock()
    sleep(seconds)
    elapsed = max(clock() - t0, 1e-9)
    return [(p.group_cpu_seconds() - c0) / elapsed for p, c0 in zip(processes, before)]


def restart_busy(processes: Sequence[_P], limit_cores: float, window_s: float) -> list[tuple[_P, float]]:
    """Restart every running process whose group used more than limit_cores of CPU over the next
    window_s seconds (all measured over the same window); returns those restarted, with the cores
    each used. A caller waits for a server to be ready again."""
    running = [p for p in processes if p.is_running()]
    busy = [(p, cores) for p, cores in zip(running, group_cores(running, window_s)) if cores > limit_cores]
    for p, cores in busy:
        logger.warning("%s used %.2f cores while idle: restarting it", p.name, cores)
        p.restart()
    return busy


def _source_root() -> Path | None:
    """The checkout holding this package, if running from one (so children can import it)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "setup.py").exists() or (root / "pyproject.toml").exists() else None


class VllmServer(ManagedProcess):
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1, tuned for small CPU hosts.

    Defaults: executor in the EngineCore process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so API
    server + EngineCore, no worker process), OMP_NUM_THREADS=1, float32, eager, seed 0,
    64 MiB KV via --kv-cache-memory-bytes, block 32. Measured on 2 cores (tiny model): ready
    in ~16 s, ~1.2 GiB RSS, ~400-570 tok/s single-stream decode; multiprocessing=True: ~24 s,
    ~1.8 GiB, slower. `cpu_bind` sets VLLM_CPU_OMP_THREADS_BIND, which vLLM only applies with
    multiprocessing=True; `pin=True` pins the whole in-process server to those cores via
    OMP_PLACES (measured ~2x slower for one busy server on 2 cores, so off by default).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        kv_cache_bytes: int = 64 * MiB,
        max_model_len: int = 1024,
        block_size: int = 32,
        dtype: str = "float32",
        seed: int = 0,
        cpu_bind: int | str | None = None,
        pin: bool = False,
        omp_threads: int = 1,
        multiprocessing: bool = False,
        served_model_name: str | None = None,
        name: str | None = None,
        log_path: str | Path | None = None,
        netns: str | None = None,
        cpus: str | None = None,
        ready_cpus: str | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        """netns: run in that network namespace (`ip netns exec`, which execs: same pid and group).
        cpus: run the whole server (every process it starts) on these cores (`taskset -c`, which
        execs too), from its start: what a benchmark pins. ready_cpus: the same once the server is
        ready (every thread of every process in its group; what vLLM binds itself, `cpu_bind`, it
        binds to the same cores), its API server and engine starting on any core: keeps another
        server's spinning workers off them with less of the start-up on one core (the TP module's
        four servers, two TP 2 ones on one core: ready in 75.5 s, pinned from the start 80.6 s,
        unpinned 68 s; one run each, 2 cores). cwd: the server's working
        directory, which `python -m` puts first on sys.path (before PYTHONPATH): another checkout's
        packages are imported only when it runs there."""
        self.model = str(model)
        self.ready_cpus = _cpu_list(ready_cpus) if ready_cpus is not None else None
        self.host = host
        self.port = port if port is not None else free_port()
        self.cpu_bind = cpu_bind
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", host,
            "--port", str(self.port),
            "--dtype", dtype,
            "--enforce-eager",
            "--seed", str(seed),
            "--max-model-len", str(max_model_len),
            "--block-size", str(block_size),
            "--kv-cache-memory-bytes", str(kv_cache_bytes),
        ]  # fmt: skip
        if served_model_name:
            argv += ["--served-model-name", served_model_name]
        argv += [str(a) for a in extra_args]
        if cpus is not None:
            argv = ["taskset", "-c", cpus, *argv]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        env = self.default_env(cpu_bind, omp_threads, multiprocessing, pin)
        env.update(extra_env or {})
        super().__init__(argv, name=name or f"vllm-{self.port}", env=env, cwd=cwd, log_path=log_path)

    @staticmethod
    def default_env(
        cpu_bind: int | str | None = None,
        omp_threads: int = 1,
        multiprocessing: bool = False,
        pin: bool = False,
    ) -> dict[str, str]:
        """Environment for a vLLM child: os.environ (read now) plus CPU-host settings."""
        env = dict(os.environ)
        # The legacy GiB knob overrides --kv-cache-memory-bytes in vLLM's CPU platform code.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0",
            OMP_NUM_THREADS=str(omp_threads),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        if cpu_bind is not None:
            # vLLM honours this in its multiprocess executor only (pins the worker's OMP threads).
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_bind)
            if pin and not multiprocessing:
                # libgomp binds the initial thread to OMP_PLACES at load, and threads inherit it:
                # this pins the whole server (API server + EngineCore) to those cores.
                env["OMP_PLACES"] = "{" + str(cpu_bind) + "}"
                env["OMP_PROC_BIND"] = "true"
        root = _source_root()
        if root is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        return env

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = 180.0) -> VllmServer:
        """Poll GET /health until 200; raise RuntimeError with the log tail on death/deadline."""
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        with httpx.Client(timeout=2.0) as client:
            while True:
                if not self.is_running():
                    raise RuntimeError(
                        f"{self.name} exited with code {self.returncode} before becoming ready;"
                        f" log {self.log_path}:\n{self.log_tail(60)}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        logger.info("%s ready in %.1fs", self.name, time.monotonic() - t0)
                        if self.ready_cpus is not None:
                            self.pin(self.ready_cpus)
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail(60)}")
                time.sleep(0.25)

    def pin(self, cpus: set[int]) -> int:
        """Every thread of every process in the group on `cpus` (threads started later inherit it from
        the thread starting them); returns how many threads were pinned."""
        pinned = 0
        for pid in self.group_pids():
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue  # ended meanwhile
            for tid in tids:
                try:
                    os.sched_setaffinity(tid, cpus)
                    pinned += 1
                except OSError:
                    continue
        return pinned

    def __enter__(self) -> VllmServer:
        super().__enter__()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self


def _cpu_list(spec: str) -> set[int]:
    """taskset's list form: "0", "0,2", "0-3,8" -> the CPU numbers."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        try:
            cpus.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"not a CPU list: {spec!r}") from None
    if not cpus:
        raise ValueError(f"not a CPU list: {spec!r}")
    return cpus


def stop_all(processes: Sequence[ManagedProcess], timeout: float = 15.0) -> None:
    """Stop every process, their shutdowns side by side: each group gets SIGTERM first, then each is
    waited for (and SIGKILLed past `timeout`) in turn."""
    for p in processes:
        p.terminate()
    for p in processes:
        p.stop(timeout)


@contextlib.contextmanager
def running(*servers: VllmServer, timeout: float = 180.0) -> Iterator[tuple[VllmServer, ...]]:
    """Start every server at once, then wait until each is ready; stop them all on the way out, also
    when one of them fails to start. A vLLM start here is mostly one core importing Python: two
    servers started together on 2 cores are ready in about the time of one (23 s against 44 s
    one after the other, measured), so servers a test needs together start together."""
    try:
        for server in servers:
            if not server.is_running():
                server.start()
        for server in servers:
            server.wait_ready(timeout)
        yield servers
    finally:
        stop_all(servers)


def completion(
    url: str,
    prompt_or_token_ids: str | Sequence[int],
    max_tokens: int = 16,
    *,
    model: str | None = None,
    timeout: float = 120.0,
    **extra: Any,
) -> dict[str, Any]:
    """POST /v1/completions greedily (temperature 0, return_token_ids); returns the JSON.

    `url` is the server base URL (".../v1/completions" is appended unless already there).
    Raises RuntimeError with the response body on a non-2xx status.
    """
    base = url.rstrip("/")
    endpoint = base if base.endswith("/v1/completions") else f"{base}/v1/completions"
    prompt: str | list[int] = prompt_or_token_ids if isinstance(prompt_or_token_ids, str) else list(prompt_or_token_ids)
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update({"return_token_ids": True, **({"model": model} if model else {}), **extra})
    resp = httpx.post(endpoint, json=body, timeout=timeout)
    if resp.status_code // 100 != 2:
        raise RuntimeError(f"POST {endpoint} -> {resp.status_code}: {resp.text[:2000]}")
    return resp.json()
