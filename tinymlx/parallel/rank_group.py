"""RankGroup: rank 0's side of tensor parallelism: the worker ranks, the MLX group they share, commands.

MLX keeps one distributed group per process (`mx.distributed.init` caches it), so a process starts
its ranks once and lends them to one engine at a time: the engine loads its model on every rank
with `load`, runs each step with `run_step`, and gives the ranks back with `release`. The worker
processes stop when this process exits (or at `shutdown`), and die with it if it is killed.

Failure: MLX's ring cannot recover from a lost rank: the first collective fails, the next one in
the same graph waits forever. So every collective of rank 0 runs on one step thread while the
caller waits, watching the worker processes: when one exits, the caller gets a TensorParallelError
(which rank, its exit status, its last output) within a tenth of a second, the step thread is
abandoned, and this process's ranks serve nothing more.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar, TypeVar

import numpy as np
from threadpoolctl import threadpool_limits

from tinymlx.core.config import EngineConfig
from tinymlx.parallel.collectives import Collectives, build_on_every_rank
from tinymlx.parallel.hostfile import Hostfile, read_hostfile
from tinymlx.parallel.launch import (
    RankLost,
    StepThread,
    TensorParallelError,
    blas_threads_per_rank,
    check_is_this_machine,
    join_ring,
    limit_blas_threads,
    ring_addresses,
    start_ranks,
    stop_ranks,
    wait_ready,
)
from tinymlx.parallel.step_broadcast import Command, pack_arrays, pack_text
from tinymlx.runner.model_runner import FINGERPRINT_FIELDS

T = TypeVar("T")
WATCH_INTERVAL_S = 0.05


class RankGroup:
    _current: ClassVar[RankGroup | None] = None

    @classmethod
    def acquire(cls, size: int, hostfile_path: str | None = None) -> RankGroup:
        """This process's ranks for a new engine: started on first use, reused after."""
        hostfile = read_hostfile(hostfile_path) if hostfile_path else Hostfile.local(size)
        if len(hostfile.hosts) != size:
            raise ValueError(f"hostfile {hostfile_path} lists {len(hostfile.hosts)} hosts for tensor_parallel_size="
                             f"{size}: one host per rank, this machine first")
        check_is_this_machine(hostfile)
        group = cls._current
        if group is None:
            group = cls._current = cls(hostfile)  # set only once started: a failed start can be retried
        elif group._failure is not None:
            raise TensorParallelError(
                f"this process's tensor-parallel ranks can serve no more ({group._failure}); MLX keeps one "
                "distributed group per process, so start a new process")
        elif group.hostfile != hostfile:
            raise TensorParallelError(
                f"this process already runs {group.size} tensor-parallel ranks on other hosts; MLX keeps one "
                f"distributed group per process: use tensor_parallel_size={group.size} and the same hosts, "
                "or start a new process")
        group._claim()
        return group

    def __init__(self, hostfile: Hostfile):
        self.hostfile, self.size = hostfile, len(hostfile.hosts)
        ring = ring_addresses(hostfile)
        self._processes = start_ranks(hostfile, lambda rank: ["tinymlx.parallel.worker", "--rank", str(rank),
                                                             "--ring", json.dumps(ring)])
        self._failure: str | None = None
        self._step_thread = StepThread()
        try:
            wait_ready(self._processes)
            self.collectives = Collectives(join_ring(0, ring))  # here: its alarm works only on the main thread
        except BaseException:
            stop_ranks(self._processes, grace_s=0)
            raise
        self._holds_model = False  # from a LOAD until its RELEASE
        self._owner: weakref.ref | None = None  # the ModelRunner built by the last good LOAD
        self._blas_limits: threadpool_limits | None = None  # while an engine holds the ranks
        self._is_stopped = False
        atexit.register(self.shutdown)

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self._processes]

    # -- lending the ranks to an engine ------------------------------------------------------------
    def _claim(self) -> None:
        if self._owner is not None and self._owner() is not None:
            raise TensorParallelError("another engine in this process is using the tensor-parallel ranks; "
                                      "close it first (LLM.close() or Engine.close())")
        self.release()  # an engine dropped without close() still has its model on the workers
        if self.hostfile.num_ranks_here > 1:
            self._blas_limits = limit_blas_threads(blas_threads_per_rank(self.hostfile))

    def load(self, model_dir: Path, config: EngineConfig, build: Callable[[], T],
             runner_of: Callable[[T], object]) -> T:
        """Every rank loads its shard of `model_dir` as `config` says; here, `build()` does.

        Then all ranks agree that each succeeded and built the same shapes (`runner.fingerprint()`);
        otherwise every rank drops what it built and this raises, with the failing rank's output.
        """
        message = json.dumps({"model_dir": str(model_dir), "config": dataclasses.asdict(config)})
        self._watched(lambda: self._command(Command.LOAD, pack_text(message)))
        self._holds_model = True
        result, error, agreed = build_on_every_rank(
            build, lambda r: runner_of(r).fingerprint(), len(FINGERPRINT_FIELDS),
            lambda values: self._watched(lambda: self.collectives.agree(values)),
        )
        if agreed:
            self._owner = weakref.ref(runner_of(result))
            return result
        self.release()
        if error is not None:
            raise error
        time.sleep(0.2)  # the workers printed their errors before agreeing; let the output readers take them
        output = "\n".join(f"rank {p.rank}:\n" + "\n".join(p.tail) for p in self._processes)
        raise TensorParallelError(f"a rank failed to load {model_dir} or built other shapes than rank 0; "
                                  f"each rank must load the same model files. Their output:\n{output}")

    def run_step(self, runner: object, arrays: list[np.ndarray], forward: Callable[[], T]) -> T:
        """Send this step's inputs to the workers, then run rank 0's `forward` (which builds and
        evaluates the graph: on the step thread, like every collective)."""
        if self._owner is None or self._owner() is not runner:
            raise TensorParallelError("the tensor-parallel ranks do not hold this engine's model (it was closed)")

        def step() -> T:
            self._command(Command.STEP, pack_arrays(arrays))
            return forward()

        return self._watched(step)

    def release(self) -> None:
        """The workers drop the model and wait for the next LOAD; the group stays up for this process."""
        self._owner = None
        if self._blas_limits is not None:
            self._blas_limits.restore_original_limits()
            self._blas_limits = None
        if self._holds_model and self._failure is None:
            with contextlib.suppress(TensorParallelError):
                self._watched(lambda: self._command(Command.RELEASE))
        self._holds_model = False

    def probe_all_reduce(self, rows: int, columns: int, repeats: int) -> list[float]:
        """Seconds per all-reduce of a float32 [rows, columns] array, timed on rank 0 (benchmarks)."""
        def probe() -> list[float]:
            self._command(Command.PROBE, np.array([rows, columns, repeats]))
            return self.collectives.time_all_reduce(rows, columns, repeats)

        return self._watched(probe)

    def _command(self, command: Command, payload: np.ndarray | None = None) -> None:
        """Wake the workers (blocked on their stdin while idle), then broadcast the command."""
        for process in self._processes:
            process.wake()
        self.collectives.broadcast(command, payload)

    # -- failure and shutdown ------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise TensorParallelError if a rank has exited or an earlier collective failed."""
        if self._failure is None:
            dead = self._dead_rank()
            if dead is not None:
                self._failure = dead
        if self._failure is not None:
            raise TensorParallelError(f"tensor-parallel ranks failed: {self._failure}")

    def _watched(self, work: Callable[[], T]) -> T:
        """Run `work` (collectives) on the step thread; wait, raising as soon as a rank is gone."""
        self.check_alive()
        with self._failing_on_error():
            try:
                return self._step_thread.run_watched(work, self._dead_rank, WATCH_INTERVAL_S)
            except RankLost as lost:
                self._failure = str(lost)
                raise TensorParallelError(f"tensor-parallel ranks failed: {lost}") from None

    def _dead_rank(self) -> str | None:
        for p in self._processes:
            if p.exit_code is not None:
                time.sleep(0.1)  # let the output reader take its last lines
                return p.describe_exit()
        return None

    @contextlib.contextmanager
    def _failing_on_error(self) -> Iterator[None]:
        """Any exception inside leaves the ranks mid-command: they serve nothing more."""
        try:
            yield
        except BaseException as error:
            if self._failure is None:
                self._failure = self._explain(error)
            if isinstance(error, Exception) and not isinstance(error, TensorParallelError):
                raise TensorParallelError(f"tensor-parallel ranks failed: {self._failure}") from error
            raise

    def _explain(self, error: BaseException) -> str:
        deadline = time.monotonic() + 1.0  # a rank whose connection dropped is exiting: name it
        while time.monotonic() < deadline:
            dead = self._dead_rank()
            if dead is not None:
                return dead
            time.sleep(0.02)
        return f"{type(error).__name__}: {error}"

    def shutdown(self) -> None:
        """Stop the worker processes (at exit, or by hand); this process can start no other group."""
        if self._is_stopped:
            return
        self._is_stopped = True
        self.release()
        is_clean = self._failure is None
        if is_clean:  # else a worker may be mid-command: stop the processes without a word
            with contextlib.suppress(BaseException):
                self._watched(lambda: self._command(Command.SHUTDOWN))
        self._failure = self._failure or "they were shut down"
        stop_ranks(self._processes, grace_s=5.0 if is_clean else 0.0)
