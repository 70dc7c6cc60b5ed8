"""The CPU path's BLAS threads (ops/cpu/blas_threads.py) follow the cores other processes leave free, look at
most every SAMPLE_EVERY_S, and stay within the count the libraries had; pinned, they never move."""

from __future__ import annotations

import pytest

from tinymlx.ops.cpu import blas_threads
from tinymlx.ops.cpu.blas_threads import BlasThreads


class FakeLibrary:
    def __init__(self, num_threads: int):
        self.num_threads = num_threads

    def set_num_threads(self, count: int) -> None:
        self.num_threads = count


class FakeMachine:
    """A 2-core machine: each `advance` is `wall` seconds in which others kept `others` cores busy and this
    process used `own` CPU seconds."""

    def __init__(self, monkeypatch):
        self.wall = self.busy = self.own = 0.0
        monkeypatch.setattr(blas_threads.os, "cpu_count", lambda: 2)
        monkeypatch.setattr(blas_threads.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(blas_threads.time, "process_time", lambda: self.own)
        monkeypatch.setattr(blas_threads, "_machine_busy_s", lambda: self.busy)

    def advance(self, wall: float, others: float, own: float) -> None:
        self.wall += wall
        self.own += own * wall
        self.busy += (others + own) * wall


@pytest.mark.parametrize(("others", "expected"), [(0.1, 2), (1.0, 1), (2.0, 1), (1.6, 1), (0.4, 2)])
def test_threads_follow_the_cores_others_leave_free(monkeypatch, others, expected):
    machine, library = FakeMachine(monkeypatch), FakeLibrary(2)
    threads = BlasThreads([library], most=2)
    threads.adapt()  # the first look only starts the count
    machine.advance(blas_threads.SAMPLE_EVERY_S, others, own=1.0)
    threads.adapt()
    assert library.num_threads == threads.num_threads == expected


def test_it_looks_at_most_every_few_seconds_and_restores_the_count_it_found(monkeypatch):
    machine, library = FakeMachine(monkeypatch), FakeLibrary(2)
    threads = BlasThreads([library], most=2)
    threads.adapt()
    machine.advance(blas_threads.SAMPLE_EVERY_S / 2, others=2.0, own=1.0)
    threads.adapt()
    assert library.num_threads == 2  # too soon to tell
    machine.advance(blas_threads.SAMPLE_EVERY_S / 2, others=2.0, own=1.0)
    threads.adapt()
    assert library.num_threads == 1
    machine.advance(blas_threads.SAMPLE_EVERY_S, others=0.0, own=1.0)
    threads.adapt()
    assert library.num_threads == 2  # the others went quiet
    threads.adapt()
    threads.restore()
    assert library.num_threads == 2


def test_pinned_or_capped_threads_never_move(monkeypatch):
    machine, pinned, capped = FakeMachine(monkeypatch), FakeLibrary(2), FakeLibrary(1)
    pinned_threads, capped_threads = BlasThreads([pinned], most=2, pinned=1), BlasThreads([capped], most=1)
    for _ in range(3):
        pinned_threads.adapt()
        capped_threads.adapt()
        machine.advance(blas_threads.SAMPLE_EVERY_S, others=0.0, own=1.0)
    assert pinned.num_threads == 1 and capped.num_threads == 1
    pinned_threads.restore()
    assert pinned.num_threads == 2  # the count the library had


def test_it_reads_this_process_and_machine(monkeypatch):
    monkeypatch.setenv(blas_threads.BLAS_THREADS_ENV, "1")
    threads = BlasThreads.of_process()
    assert threads.pinned == 1 and threads.most >= 1
    assert blas_threads._machine_busy_s() is None or blas_threads._machine_busy_s() > 0
    threads.restore()
