"""How many threads the BLAS libraries run with on the CPU's path: as many as the cores other processes leave
free, looked at between steps, at most every few seconds.

Why, measured on a 2-core EPYC shared with other work (the default 0.5B in float32, single-stream decode,
median tok/s of 3-5 rounds; issue #55): OpenBLAS's threads spin while they wait for work. Beside two busy
processes its default two threads decoded 0.5-4.5 tok/s (four runs) and one thread 1.5 and 4.9 (two runs);
these counts decoded 4.8-5.1 in three runs of four (2.3 in one). With no busy process beside it, two threads
decoded 12.7 against 6.6-6.9 with one, and these counts 12.2.

Both libraries count: numpy's own OpenBLAS runs the one-row gemvs (linear.py, the runner's one-row step), the
one MLX links (Debian's, preloaded) the sgemms of wider steps. The count stays within what the libraries had
when the runner was built (OpenBLAS's default of one a core, OPENBLAS_NUM_THREADS, or a tensor-parallel rank's
limit); TINYMLX_BLAS_THREADS pins it.
"""

from __future__ import annotations

import os
import time

from threadpoolctl import ThreadpoolController

BLAS_THREADS_ENV = "TINYMLX_BLAS_THREADS"
SAMPLE_EVERY_S = 2.0  # the CPU time others took is averaged over at least this long
_first_most: int | None = None  # the libraries' thread count when this process first asked (of_process)


class BlasThreads:
    """Sets every BLAS library's thread count to the cores free of other processes' work (`adapt`, between
    steps), within [1, `most`]; pinned, it sets `pinned` once and never looks again."""

    def __init__(self, libraries: list, most: int, pinned: int | None = None):
        self.libraries, self.most, self.pinned = libraries, most, pinned
        self.num_threads = max((library.num_threads for library in libraries), default=most)  # as they are now
        if pinned:
            self._set(pinned)
        self._last: tuple[float, float, float] | None = None  # (wall s, busy CPU s of the machine, own CPU s)

    @classmethod
    def of_process(cls) -> BlasThreads:
        """Over the BLAS libraries loaded in this process (none: `adapt` does nothing), up to the count they had
        when the process first asked: a runner dropped without closing leaves its adapted count behind, which
        the next runner must not take for the most (it kept a benchmark's later engines at one thread)."""
        global _first_most
        libraries = ThreadpoolController().select(user_api="blas").lib_controllers
        if _first_most is None:
            _first_most = max((library.num_threads for library in libraries), default=1)
        pinned = os.environ.get(BLAS_THREADS_ENV)
        return cls(libraries, _first_most, int(pinned) if pinned else None)

    def adapt(self) -> None:
        """Follow the cores other processes left free since the last look, if that was SAMPLE_EVERY_S ago."""
        if self.pinned or not self.libraries or self.most == 1:
            return
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < SAMPLE_EVERY_S:
            return
        sample = (now, _machine_busy_s(), time.process_time())
        if self._last is not None and sample[1] is not None and self._last[1] is not None:
            wall, busy, own = (a - b for a, b in zip(sample, self._last))
            others = max(0.0, busy - own) / wall  # cores' worth of other processes' work
            wanted = min(self.most, max(1, round((os.cpu_count() or self.most) - others)))
            if wanted != self.num_threads:
                self._set(wanted)
        self._last = sample

    def restore(self) -> None:
        """The count the libraries had (the runner is closing: the next one starts from it)."""
        if self.num_threads != self.most:
            self._set(self.most)

    def _set(self, count: int) -> None:
        for library in self.libraries:
            library.set_num_threads(count)
        self.num_threads = count


def _machine_busy_s() -> float | None:
    """Seconds every CPU of the machine spent busy since boot (/proc/stat; None where there is none)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user .. steal: guest time is in user already
