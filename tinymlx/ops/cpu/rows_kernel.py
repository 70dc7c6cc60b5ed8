"""Two to four float32 rows times a weight in one pass over it: a kernel compiled by numba, for the CPU.

Why, measured on a 2-core Xeon (AVX-512; 48 [4864, 896] float32 weights in turn, so that the caches hold
none; docs/perf-notes.md): a step of a few rows (a verified draft chunk, a small batch of decodes) only
streams the weights, like one row, but BLAS multiplies them through sgemm, which read them at 9-11 GB/s
(numpy's and MLX's alike) against the one-row gemv's 34. This kernel keeps 16 sums in registers (4 rows x
4 outputs) and reads each weight once: 25 GB/s for 4 rows, so a 4-row linear costs 1.4x a one-row one
instead of 3x. Wider steps stay in BLAS, where more rows per byte pay (and 8 rows here ran at 13 GB/s).

It reads the weight in Hugging Face's [out, in] layout only: over an input-major [in, out] weight the same
sums ran at 8 GB/s. numba is a Linux dependency (pyproject.toml): where it is missing, `available()` is
False and every such step stays in MLX. Parallel kernels of the workqueue threading layer (below) must not
be entered from two threads at once (tensor-parallel ranks in one process), hence the lock.
"""

from __future__ import annotations

import importlib.util
import threading

import numpy as np

MAX_ROWS = 4
_NUMBA_INSTALLED = importlib.util.find_spec("numba") is not None
_lock = threading.Lock()
_kernel = None
numba = None  # the module, once imported: _four_rows reads its prange when numba compiles it


def available() -> bool:
    """Whether numba is installed (a Linux dependency; a Mac's GPU never runs the CPU's kernels). It is
    imported at the first compile, not with tinymlx (0.5 s)."""
    return _NUMBA_INSTALLED


def times(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [rows, in] (2 to MAX_ROWS rows) @ weight.T, weight [out, in] C-contiguous: [rows, out] float32."""
    rows = x.shape[0]
    padded = np.zeros((MAX_ROWS, x.shape[1]), dtype=np.float32)  # missing rows cost no extra read of W
    padded[:rows] = x
    out = np.empty((MAX_ROWS, weight.shape[0]), dtype=np.float32)
    with _lock:
        _compiled()(padded, weight, out)
    return out[:rows]


def warm_up() -> None:
    """Compile now (a load calls this), not in the first step that needs the kernel: 0.7 s the first time on
    a machine, then 0.1 s from numba's cache (measured)."""
    if available():
        times(np.zeros((2, 4), dtype=np.float32), np.zeros((5, 4), dtype=np.float32))


def _compiled():
    global _kernel, numba
    if _kernel is None:
        import numba

        # numba's default OpenMP threads spin after each kernel, and so do BLAS's after each product: between
        # MLX's sgemms the kernel read 4.7 GB/s against 24 alone (measured). The workqueue's threads sleep.
        numba.config.THREADING_LAYER = "workqueue"
        # reassoc: the sums may be split across SIMD lanes (float32 rounding, as BLAS's own order differs)
        _kernel = numba.njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)(_four_rows)
    return _kernel


def _four_rows(x, weight, out):  # pragma: no cover - compiled by numba, whose calls coverage cannot see
    """out[r, j] = x[r] . weight[j] for x [4, in], weight [out, in]: four outputs of four rows per pass."""
    n, k_size = weight.shape
    x0, x1, x2, x3 = x[0], x[1], x[2], x[3]
    for block in numba.prange(n // 4):
        j = 4 * block
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = np.float32(0.0)
        for k in range(k_size):
            wa, wb, wc, wd = weight[j, k], weight[j + 1, k], weight[j + 2, k], weight[j + 3, k]
            v0, v1, v2, v3 = x0[k], x1[k], x2[k], x3[k]
            a0 += v0 * wa
            a1 += v1 * wa
            a2 += v2 * wa
            a3 += v3 * wa
            b0 += v0 * wb
            b1 += v1 * wb
            b2 += v2 * wb
            b3 += v3 * wb
            c0 += v0 * wc
            c1 += v1 * wc
            c2 += v2 * wc
            c3 += v3 * wc
            d0 += v0 * wd
            d1 += v1 * wd
            d2 += v2 * wd
            d3 += v3 * wd
        out[0, j], out[1, j], out[2, j], out[3, j] = a0, a1, a2, a3
        out[0, j + 1], out[1, j + 1], out[2, j + 1], out[3, j + 1] = b0, b1, b2, b3
        out[0, j + 2], out[1, j + 2], out[2, j + 2], out[3, j + 2] = c0, c1, c2, c3
        out[0, j + 3], out[1, j + 3], out[2, j + 3], out[3, j + 3] = d0, d1, d2, d3
    for j in range(n - n % 4, n):  # the last outputs of a width not a multiple of 4
        for r in range(4):
            total = np.float32(0.0)
            for k in range(k_size):
                total += x[r, k] * weight[j, k]
            out[r, j] = total
