"""PipelineGroup: rank 0's side of pipeline parallelism: the stage workers, their links, the step's hand-offs.

Rank 0 runs the last stage, schedules and samples (as mlx-lm's pipeline does); rank r runs stage
`num_stages - 1 - r // T` as its tensor-parallel rank `r % T` (T: the tensor-parallel size, 1 without), so the
hidden states flow from the highest ranks down to rank 0's stage. A stage's T ranks share an MLX ring of their
own (rank 0's stage: with rank 0), and each hands its hidden states to the next stage's rank of its place. Each
step rank 0 sends the step's host inputs (runner/step_inputs.py) to every worker; the first stage embeds the
tokens, each stage sends its hidden states on to the next, and rank 0 runs its layers on what the stage before
sent.

The workers are started for one engine and stopped with it. Failure: a worker that exits closes its links,
and rank 0, which watches every worker's process while it waits, raises a PipelineParallelError naming the
stage, its host and its last output within a tenth of a second; one that hangs (stopped, or stuck holding its
interpreter) stops its heartbeat and is named after SILENT_S. Then rank 0 stops the other workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TypeVar

import mlx.core as mx
import numpy as np

from tinymlx.core.config import EngineConfig
from tinymlx.core.outputs import StageStats
from tinymlx.core.pipeline_stage import PipelineStage
from tinymlx.models import StageCosts
from tinymlx.parallel.collectives import Collectives
from tinymlx.parallel.hostfile import Hostfile, read_hostfile
from tinymlx.parallel.launch import (
    ParallelError,
    RankLost,
    StepThread,
    TensorParallelError,
    blas_threads_per_rank,
    check_is_this_machine,
    free_addresses,
    join_ring,
    limit_blas_threads,
    start_ranks,
    stop_ranks,
    wait_ready,
)
from tinymlx.parallel.pipeline_wire import (
    LinkKind,
    accept,
    connect,
    read_load_reply,
    receive_command,
    send_command,
)
from tinymlx.parallel.rank_group import RankGroup
from tinymlx.parallel.stage_link import StageLink, StageLinkError, StageListener
from tinymlx.parallel.stage_split import split_layers
from tinymlx.parallel.step_broadcast import Command, pack_text
from tinymlx.runner.model_runner import FINGERPRINT_FIELDS

T = TypeVar("T")
WATCH_INTERVAL_S = 0.05
SILENT_S = 5.0  # a worker's heartbeats (every launch.HEARTBEAT_S) stopped this long: it is hung
STAGE_OWN_FIELDS = ("state_floats_per_slot",)  # a stage keeps its own layers' states: the one field that differs


class PipelineParallelError(ParallelError):
    """The pipeline's stage workers cannot start, or one failed."""


def plan_stages(costs: StageCosts, num_stages: int) -> tuple[PipelineStage, ...]:
    """Each stage's layers, balanced by cost (models.stage_costs), in pipeline order."""
    return tuple(PipelineStage(index, num_stages, layers) for index, layers in
                 enumerate(split_layers(costs.layers, num_stages, costs.first, costs.last, costs.cuts)))


@dataclass
class PipelineCounters:
    """What the steps so far cost each stage, and the links (one writer: PipelineGroup.run_step)."""

    num_stages: int
    busy_s: np.ndarray = field(init=False)  # each stage's computing in the last step
    busy_s_total: np.ndarray = field(init=False)
    sent_bytes_total: np.ndarray = field(init=False)  # each stage's sends: rank 0's the steps' inputs, the others' hidden states
    wall_s_total: float = 0.0
    bytes_last_step: int = 0
    num_micro_batches: int = 0  # the last step's

    def __post_init__(self) -> None:
        self.busy_s, self.busy_s_total = np.zeros(self.num_stages), np.zeros(self.num_stages)
        self.sent_bytes_total = np.zeros(self.num_stages, dtype=np.int64)

    def record(self, busy_s: np.ndarray, wall_s: float, sent_bytes: np.ndarray, num_micro_batches: int) -> None:
        self.busy_s, self.busy_s_total = busy_s, self.busy_s_total + busy_s
        self.wall_s_total += wall_s
        self.bytes_last_step, self.sent_bytes_total = int(sent_bytes.sum()), self.sent_bytes_total + sent_bytes
        self.num_micro_batches = num_micro_batches

    @property
    def bubble_fraction(self) -> float:
        """The stages' idle share of the steps' time so far."""
        if not self.wall_s_total:
            return 0.0
        return max(0.0, 1.0 - float(self.busy_s_total.sum()) / (self.num_stages * self.wall_s_total))


class PipelineGroup:
    # Rank 0 of a stage's tensor-parallel ranks joins their MLX ring, which MLX keeps for the whole process: once
    # its peers are stopped, no later engine of this process can use it.
    _has_joined_a_ring: ClassVar[bool] = False

    def __init__(self, stages: tuple[PipelineStage, ...], hostfile_path: str | None = None,
                 tensor_parallel_size: int = 1):
        """`stages`: each one's layers (`plan_stages`). Rank r runs stage `num_stages - 1 - r // tensor_parallel_size`
        as that stage's tensor-parallel rank `r % tensor_parallel_size`: rank 0 and its tensor-parallel ranks the
        last stage, the highest ranks the first."""
        num_stages, size = len(stages), tensor_parallel_size
        hostfile = read_hostfile(hostfile_path) if hostfile_path else Hostfile.local(num_stages * size)
        if len(hostfile.hosts) != num_stages * size:
            raise ValueError(f"hostfile {hostfile_path} lists {len(hostfile.hosts)} hosts for pipeline_parallel_size="
                             f"{num_stages} x tensor_parallel_size={size}: one host per rank, this machine (the last "
                             "stage) first")
        check_is_this_machine(hostfile)
        if size > 1 and (PipelineGroup._has_joined_a_ring or RankGroup._current is not None):
            raise PipelineParallelError("this process already joined an MLX group (tensor parallelism), which MLX keeps "
                                        "for the whole process: run pipeline with tensor parallelism in a new process")
        self.hostfile, self.stages, self.num_stages, self.tensor_parallel_size = hostfile, stages, num_stages, size
        self._failure: str | None = None
        self._controls: list[StageLink] = []
        self._hidden_in: StageLink | None = None
        self.collectives: Collectives | None = None  # rank 0's stage's tensor-parallel ranks
        self.counters = PipelineCounters(num_stages)
        self._memory: dict[int, tuple[int, int]] = {}  # each worker's stage: (weights bytes, pool bytes), from load
        links, rings = zip(*free_addresses(hostfile, 2))
        host, port = links[0].rsplit(":", 1)
        listener = StageListener(host, int(port))
        self._processes = start_ranks(hostfile, lambda rank: self._worker(rank, list(links), list(rings)))
        # Ranks sharing this machine share its cores: rank 0 takes its share, as each worker does (launch.py).
        self._blas_limits = limit_blas_threads(blas_threads_per_rank(hostfile)) if hostfile.num_ranks_here > 1 else None
        self._step_thread = StepThread() if size > 1 else None
        try:
            wait_ready(self._processes, PipelineParallelError)
            if size > 1:  # here, on the main thread: join_ring's alarm needs it
                PipelineGroup._has_joined_a_ring = True
                self.collectives = Collectives(join_ring(0, list(rings[:size])))
            self._controls = [connect(links[p.rank], LinkKind.CONTROL, f"rank 0 -> {self._where(p.rank)}")
                              for p in self._processes]
            last = num_stages - 1
            self._hidden_in = accept(listener, {LinkKind.HIDDEN: f"{self._where(size)} -> stage {last} (rank 0)"})[
                LinkKind.HIDDEN]
        except (StageLinkError, TensorParallelError) as error:
            self._failure = self._explain(error)
            self._stop()
            raise PipelineParallelError(f"the pipeline's stages could not connect: {self._failure}") from None
        except BaseException:
            self._stop()
            raise
        finally:
            listener.close()

    def _worker(self, rank: int, links: list[str], rings: list[str]) -> list[str]:
        """A worker's module and arguments: its stage, its links' addresses, its stage's ring."""
        size, stage = self.tensor_parallel_size, self.stage_of(rank)
        command = ["tinymlx.parallel.stage_worker", "--rank", str(rank), "--stage", str(stage),
                   "--addresses", json.dumps(links)]
        if stage < self.num_stages - 1:  # the next stage's rank of the same place in its ring
            command += ["--next-rank", str(rank - size)]
        if size > 1:
            first = rank - rank % size
            command += ["--ring", json.dumps(rings[first:first + size]), "--tp-rank", str(rank % size)]
        return command

    def stage_of(self, rank: int) -> int:
        return self.num_stages - 1 - rank // self.tensor_parallel_size

    def rank_of(self, stage: int) -> int:
        """The stage's tensor-parallel rank 0."""
        return (self.num_stages - 1 - stage) * self.tensor_parallel_size

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self._processes]

    def load(self, model_dir: Path, config: EngineConfig, fingerprint: list[int]) -> None:
        """Every worker loads its stage of `model_dir` with `config` (resolved: each builds a pool of its pages), and
        must build what rank 0 built (`fingerprint`: ModelRunner.fingerprint), but for its own layers' states."""
        # Rank 0's pages; no budget to size them again, and no draft's pool (the draft runs on rank 0).
        sent = dataclasses.replace(config, step_shape=None, activation_bytes=0, state_slot_pages=0, resolved=False,
                                   kv_cache_bytes=None, memory_budget_bytes=None, companion_page_bytes=0)
        for process, control in zip(self._processes, self._controls):
            stage = self.stages[self.stage_of(process.rank)]
            message = {"model_dir": str(model_dir), "config": dataclasses.asdict(sent), "num_stages": self.num_stages,
                       "layers": [stage.layers.start, stage.layers.stop]}
            self._watched(lambda control=control, message=message: send_command(
                control, Command.LOAD, [pack_text(json.dumps(message))]))
        for process, control in zip(self._processes, self._controls):
            reply, error = read_load_reply(self._watched(lambda control=control: receive_command(control)[1],
                                                         waiting_on=control))
            if reply is None:
                self.close()
                raise PipelineParallelError(f"{self._where(process.rank)} failed to load {model_dir}: {error}")
            theirs, memory = reply
            differ = [name for name, mine, their in zip(FINGERPRINT_FIELDS, fingerprint, theirs)
                      if mine != their and name not in STAGE_OWN_FIELDS]
            if differ:
                self.close()
                raise PipelineParallelError(f"{self._where(process.rank)} built other shapes than rank 0 "
                                            f"({', '.join(differ)}): every rank must load the same model files")
            if process.rank == self.rank_of(self.stage_of(process.rank)):
                self._memory[self.stage_of(process.rank)] = memory

    def stage_stats(self, weights_bytes: int, pool_bytes: int) -> tuple[StageStats, ...]:
        """Every stage's (its tensor-parallel rank 0's), rank 0's from its own `weights_bytes` and `pool_bytes`."""
        memory = {**self._memory, self.num_stages - 1: (weights_bytes, pool_bytes)}
        return tuple(StageStats(stage.index, (stage.layers.start, stage.layers.stop),
                                self.hostfile.hosts[self.rank_of(stage.index)].ssh, *memory[stage.index],
                                float(self.counters.busy_s[stage.index]), float(self.counters.busy_s_total[stage.index]),
                                int(self.counters.sent_bytes_total[stage.index]))
                     for stage in self.stages)

    def run_step(self, micro_batches: list[list[np.ndarray]], last_stage: Callable[[int, mx.array], None]) -> None:
        """One step of `micro_batches` (each one's host inputs): every stage runs them in order, each handing its
        hidden states on as soon as it has them, so that stage s works on micro-batch m + 1 while stage s + 1 works
        on m. `last_stage(m, hidden)` runs rank 0's layers on micro-batch m (evaluated before it returns).

        With tensor-parallel ranks beside rank 0, its layers' collectives wait on theirs, and MLX's ring waits
        forever for a rank that died: the step runs on a thread of its own while this one watches the workers."""
        if self._step_thread is None:
            return self._run_step(micro_batches, last_stage)
        self.check_alive()
        try:
            return self._step_thread.run_watched(lambda: self._run_step(micro_batches, last_stage), self._dead_rank,
                                                 WATCH_INTERVAL_S)
        except RankLost as lost:
            self._fail(str(lost))
            raise PipelineParallelError(f"pipeline stages failed: {lost}") from None
        except PipelineParallelError:
            raise
        except Exception as error:  # MLX's ring lost a peer: name it
            self._fail(self._explain(error))
            raise PipelineParallelError(f"pipeline stages failed: {self._failure}") from error

    def _run_step(self, micro_batches: list[list[np.ndarray]], last_stage: Callable[[int, mx.array], None]) -> None:
        started, before = time.perf_counter(), sum(link.bytes_sent for link in self._controls)
        counts = np.array([len(arrays) for arrays in micro_batches], dtype=np.int32)
        payload = [counts, *(array for arrays in micro_batches for array in arrays)]
        self._watched(lambda: [send_command(control, Command.STEP, payload) for control in self._controls])
        busy = np.zeros(self.num_stages)
        handed_off = 0
        for index in range(len(micro_batches)):
            hidden, stages_busy = self._watched(self._hidden_in.receive, waiting_on=self._hidden_in)
            began = time.perf_counter()
            last_stage(index, hidden)
            busy += [*np.array(stages_busy).tolist(), time.perf_counter() - began]
            handed_off += hidden.nbytes
        # Rank 0 sent the step's inputs to every worker; each stage before its own handed on hidden states of the
        # shape it receives.
        sent = np.full(self.num_stages, handed_off, dtype=np.int64)
        sent[-1] = sum(link.bytes_sent for link in self._controls) - before
        self.counters.record(busy, time.perf_counter() - started, sent, len(micro_batches))

    # -- failure and shutdown ------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise PipelineParallelError if a worker has exited or an earlier step failed."""
        if self._failure is None:
            dead = self._dead_rank()
            if dead is not None:
                self._fail(dead)
        if self._failure is not None:
            raise PipelineParallelError(f"pipeline stages failed: {self._failure}")

    def _watched(self, work: Callable[[], T], waiting_on: StageLink | None = None) -> T:
        """Run `work` (link traffic); when it waits on `waiting_on`, wait there watching the workers, raising as
        soon as one is gone."""
        self.check_alive()
        with self._failing_on_error():
            while waiting_on is not None and not waiting_on.wait_readable(WATCH_INTERVAL_S):
                dead = self._dead_rank()
                if dead is not None:
                    self._fail(dead)
                    raise PipelineParallelError(f"pipeline stages failed: {dead}")
            return work()

    @contextlib.contextmanager
    def _failing_on_error(self) -> Iterator[None]:
        try:
            yield
        except StageLinkError as error:
            self._fail(self._explain(error))
            raise PipelineParallelError(f"pipeline stages failed: {self._failure}") from None

    def _fail(self, why: str) -> None:
        """The workers serve nothing more: stop them now, so none is left running."""
        if self._failure is None:
            self._failure = why
        self._stop(grace_s=0.0)

    def _explain(self, error: Exception) -> str:
        deadline = time.monotonic() + 1.0  # a link drops as its worker exits: name the worker
        while time.monotonic() < deadline:
            dead = self._dead_rank()
            if dead is not None:
                return dead
            time.sleep(0.02)
        return str(error)

    def _dead_rank(self) -> str | None:
        """A worker that exited, or has said nothing for SILENT_S (stopped, or stuck holding its interpreter)."""
        for p in self._processes:
            where = f"{self._where(p.rank)} on {self.hostfile.hosts[p.rank].ssh}"
            if p.exit_code is not None:
                time.sleep(0.1)  # let the output reader take its last lines
                return f"{where}: {p.describe_exit()}"
            silent = time.monotonic() - p.last_beat
            if silent > SILENT_S:
                return f"{where}: rank {p.rank} (pid {p.process.pid}) has given no sign of life for {silent:.0f} s"
        return None

    def _where(self, rank: int) -> str:
        return f"stage {self.stage_of(rank)} (rank {rank})"

    def close(self) -> None:
        """Stop the workers: SHUTDOWN where they are well (they exit within a few seconds), else at once."""
        grace_s = 0.0
        if self._failure is None:
            for control in self._controls:
                with contextlib.suppress(StageLinkError):
                    send_command(control, Command.SHUTDOWN)
            self._failure, grace_s = "they were shut down", 5.0
        self._stop(grace_s)

    def _stop(self, grace_s: float = 0.0) -> None:
        if self._blas_limits is not None:
            self._blas_limits.restore_original_limits()
            self._blas_limits = None
        for link in (*self._controls, *([self._hidden_in] if self._hidden_in is not None else [])):
            link.close()
        stop_ranks(self._processes, grace_s)
