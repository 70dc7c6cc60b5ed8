"""Start the worker ranks, the way `mlx.launch` does for the ring backend, and stop them.

Each worker gets its rank and the ring's addresses (what `mlx.launch` puts in MLX_RANK and
MLX_HOSTFILE), runs `python -m tinymlx.parallel.worker`, and prints a ready line once its imports
are done; rank 0 joins the ring only after every worker is ready, so a rank that fails to start is
reported (with its output) instead of leaving rank 0 waiting in the ring's accept.
Local ranks run in their own session, so a Ctrl+C in the terminal reaches rank 0 alone, which
then stops them; they also exit when rank 0's process dies (they watch for it).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
from threadpoolctl import threadpool_limits

from tinymlx.core.config import EngineConfig
from tinymlx.loader import resolve_model_dir
from tinymlx.parallel.hostfile import Hostfile

T = TypeVar("T")
READY_LINE = "tinymlx-rank-ready"
ALIVE_LINE = "tinymlx-rank-alive"  # a worker's heartbeat (`beat`), every HEARTBEAT_S
START_TIMEOUT_S = 120.0  # a worker's imports; a remote one's ssh log-in too
JOIN_TIMEOUT_S = 60.0  # the ring's connect retries give up after 31 s


class ParallelError(RuntimeError):
    """Worker ranks cannot start or one failed: the message says which and why."""


class RankLost(Exception):
    """A rank exited or hung while rank 0 waited on its step thread: the message describes it."""


class TensorParallelError(ParallelError):
    """The tensor-parallel ranks cannot start or a rank failed."""


def ring_addresses(hostfile: Hostfile) -> list[list[str]]:
    """'ip:port' for each rank and connection: free ports found here, all different (held open together
    while chosen), so ranks sharing an ip never collide; ports this high are as likely free elsewhere."""
    with _free_ports() as pick:
        return [[f"{ip}:{pick()}" for ip in host.ips] for host in hostfile.hosts]


def free_addresses(hostfile: Hostfile, per_host: int) -> list[list[str]]:
    """`per_host` 'ip:port' on each host's first ip, chosen as ring_addresses chooses them."""
    with _free_ports() as pick:
        return [[f"{host.ips[0]}:{pick()}" for _ in range(per_host)] for host in hostfile.hosts]


@contextlib.contextmanager
def _free_ports() -> Iterator[Callable[[], int]]:
    """A picker of free ports, each held open until the block ends, so that no two are the same."""
    probes: list[socket.socket] = []

    def pick() -> int:
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.bind(("127.0.0.1", 0))
        probes.append(probe)
        return probe.getsockname()[1]

    try:
        yield pick
    finally:
        for probe in probes:
            probe.close()


def check_is_this_machine(hostfile: Hostfile) -> None:
    """Rank 0 listens on the first host's ips: fail now, clearly, if they belong to another machine."""
    for ip in hostfile.hosts[0].ips:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((ip, 0))
            except OSError as error:
                raise TensorParallelError(
                    f"rank 0 runs here but cannot listen on {ip} ({error.strerror}): the first host of the "
                    "hostfile must be this machine, with one of its own IP addresses"
                ) from None


HEARTBEAT_S = 0.5


class RankProcess:
    """One worker rank's process; a thread keeps the tail of its output and notices its ready line and
    its heartbeats."""

    def __init__(self, rank: int, worker: list[str], host_ssh: str | None, envs: tuple[str, ...],
                 blas_threads: int):
        """`worker`: the worker's module and its arguments (`python -m` runs them)."""
        self.rank = rank
        self.ready = threading.Event()
        self.tail: deque[str] = deque(maxlen=40)
        self.last_beat = time.monotonic()  # when its output last said it was alive (workers that `beat`)
        command = [sys.executable, "-m", *worker]
        env_pairs = dict(e.split("=", 1) for e in envs)
        if host_ssh is None:
            command += ["--parent-pid", str(os.getpid())]
            env = {**os.environ, "OPENBLAS_NUM_THREADS": str(blas_threads), **env_pairs}
        else:  # as mlx.launch: the same python and working directory on the other machine
            exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env_pairs.items())
            remote = f"cd {shlex.quote(os.getcwd())}; {exports}exec {shlex.join(command)}"
            command, env = ["ssh", "-tt", "-o", "LogLevel=QUIET", "-o", "BatchMode=yes", host_ssh, remote], None
        self.process = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", start_new_session=True,
        )
        threading.Thread(target=self._read_output, name=f"tinymlx-rank-{rank}-output", daemon=True).start()

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    def wake(self) -> None:
        """Tell the worker a command follows. MLX's ring polls while it waits for data (half a core per
        idle rank, measured), so an idle worker blocks on its stdin instead (over ssh too)."""
        with contextlib.suppress(OSError):  # a dead rank: the watcher reports it, with its output
            self.process.stdin.write("\n")
            self.process.stdin.flush()

    def describe_exit(self) -> str:
        code = self.process.poll()
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        output = "\n".join(f"  | {line}" for line in self.tail)
        return f"rank {self.rank} (pid {self.process.pid}) {how}" + (f"; its last output:\n{output}" if output else "")

    def _read_output(self) -> None:
        for line in self.process.stdout:
            line = line.rstrip()
            if line == ALIVE_LINE:
                self.last_beat = time.monotonic()
            elif line == READY_LINE:
                self.ready.set()
            elif line:
                self.tail.append(line)


def model_dir_here(rank0_dir: str, config: EngineConfig) -> Path:
    """The model a worker loads: rank 0's directory where this machine has it; else the model by name (fetched or
    converted here)."""
    path = Path(rank0_dir)
    return path if path.is_dir() else resolve_model_dir(config.model, progress=False, dtype=config.dtype)


def beat() -> None:
    """Say this worker is alive on its output every HEARTBEAT_S, from a thread: one stopped or stuck holding the
    interpreter falls silent, which rank 0 notices (RankProcess.last_beat) where no link would fail."""
    def loop() -> None:
        while True:
            print(ALIVE_LINE, flush=True)
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=loop, name="tinymlx-heartbeat", daemon=True).start()


def exit_with_parent(parent_pid: int) -> None:
    """A worker never outlives rank 0. A thread polls for a new parent (the GIL is free while collectives wait);
    not PR_SET_PDEATHSIG, which fires when the parent's *thread* that started us ends."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="tinymlx-parent-watch", daemon=True).start()


def blas_threads_per_rank(hostfile: Hostfile) -> int:
    return max(1, (os.cpu_count() or 1) // hostfile.num_ranks_here)


def start_ranks(hostfile: Hostfile, worker_of: Callable[[int], list[str]]) -> list[RankProcess]:
    """A process for each rank after 0, running `worker_of(rank)` (a module and its arguments)."""
    threads = blas_threads_per_rank(hostfile)
    return [RankProcess(rank, worker_of(rank), None if host.is_local else host.ssh, hostfile.envs, threads)
            for rank, host in enumerate(hostfile.hosts[1:], start=1)]


def wait_ready(processes: list[RankProcess], error: type[ParallelError] = TensorParallelError,
               timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once every rank is ready; raise `error` as soon as one exits, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while not all(p.ready.is_set() for p in processes):
        for p in processes:
            if p.exit_code is not None:
                time.sleep(0.1)  # let the reader thread take the last lines
                raise error(f"a rank failed to start: {p.describe_exit()}")
        if time.monotonic() > deadline:
            late = [p.rank for p in processes if not p.ready.is_set()]
            raise error(f"rank(s) {late} did not start within {timeout_s:.0f} s")
        time.sleep(0.02)


def stop_ranks(processes: list[RankProcess], grace_s: float = 5.0) -> None:
    """Wait up to `grace_s` for the ranks to exit by themselves, then terminate, then kill."""
    deadline = time.monotonic() + grace_s
    for p in processes:
        try:
            p.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.process.terminate()
    for p in processes:
        try:
            p.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            p.process.kill()
            p.process.wait()


def limit_blas_threads(count: int) -> threadpool_limits:
    """Limit every BLAS library in this process to `count` threads: MLX's, and numpy's own OpenBLAS, which the
    CPU's one-row linears call (ops/cpu/linear.py). `restore_original_limits()` on the result undoes it.

    Ranks sharing one machine must not share its cores with each other's BLAS threads: measured on
    2 cores, an all-reduce of one token went from 0.5 ms to 1.4-11 ms with default threads, and with
    numpy's OpenBLAS left at 2 threads a decode step of the 0.5B at TP=2 took 652 ms against 99 at TP=1."""
    return threadpool_limits(limits=count, user_api="blas")


def join_ring(rank: int, ring: list[list[str]], timeout_s: float = JOIN_TIMEOUT_S) -> mx.distributed.Group:
    """mx.distributed.init over the ring, as `mlx.launch` would set it up for this rank.

    The ring's accept blocks while holding the GIL, so no thread could time it out; in the main
    thread an alarm does (SIGALRM interrupts the accept). Elsewhere the ready handshake bounds it.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="tinymlx-ring-", delete=False) as file:
        json.dump(ring, file)
    saved = {key: os.environ.get(key) for key in ("MLX_RANK", "MLX_HOSTFILE")}
    os.environ.update(MLX_RANK=str(rank), MLX_HOSTFILE=file.name)
    try:
        with _alarm(timeout_s):
            group = mx.distributed.init(strict=True, backend="ring")
    except (RuntimeError, TimeoutError) as error:
        raise TensorParallelError(f"rank {rank} could not join the ring {ring}: {error}") from None
    finally:
        os.unlink(file.name)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if group.size() != len(ring) or group.rank() != rank:
        raise TensorParallelError(f"joined a group of {group.size()} ranks as rank {group.rank()}, "
                                  f"expected {len(ring)} as rank {rank}: another group was initialized here")
    return group


@contextlib.contextmanager
def _alarm(timeout_s: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum, _frame):
        raise TimeoutError(f"no connection within {timeout_s:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class StepThread:
    """One daemon thread running rank 0's collectives in order. A daemon, so a thread stuck in a
    failed ring never keeps the process from exiting."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[tuple[Callable, Future]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="tinymlx-rank0-step", daemon=True).start()

    def submit(self, work: Callable[[], T]) -> Future:
        done: Future = Future()
        self._work.put((work, done))
        return done

    def run_watched(self, work: Callable[[], T], dead_rank: Callable[[], str | None],
                    interval_s: float = 0.05) -> T:
        """`work`'s result, run here while the caller waits; RankLost, naming the rank `dead_rank` finds gone, as
        soon as it finds one (`work` stays stuck here, on a daemon thread)."""
        done = self.submit(work)
        while True:
            try:
                return done.result(timeout=interval_s)
            except FutureTimeout:
                dead = dead_rank()
                if dead is not None:
                    raise RankLost(dead) from None

    def _run(self) -> None:
        while True:
            work, done = self._work.get()
            try:
                done.set_result(work())
            except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
                done.set_exception(error)
