"""Two to eight float32 rows times a weight in one pass over it: kernels compiled by numba, for the CPU.

Why, measured on a 2-core Xeon (AVX-512; 48 [4864, 896] float32 weights in turn, so that the caches hold
none; docs/perf-notes.md): a step of a few rows (a verified draft chunk, a small batch of decodes) only
streams the weights, like one row, but BLAS multiplies them through sgemm, which read them at 10-11 GB/s
(numpy's and MLX's alike) against the one-row gemv's 34. These kernels keep their sums in registers and
read each weight once: 4 rows x 4 outputs at a time read 25 GB/s (a 4-row linear costs 1.4x a one-row one
instead of 3x), 8 rows x 3 outputs 17-18 GB/s. Wider steps stay in BLAS, where more rows per byte pay.

They read the weight in Hugging Face's [out, in] layout only: over an input-major [in, out] weight the
same sums ran at 8 GB/s. numba is a Linux dependency (pyproject.toml): where it is missing, `available()`
is False and every such step stays in MLX. Parallel kernels of the workqueue threading layer (below) must
not be entered from two threads at once (tensor-parallel ranks in one process), hence the lock.
"""

from __future__ import annotations

import importlib.util
import threading

import numpy as np

MAX_ROWS = 8
_NUMBA_INSTALLED = importlib.util.find_spec("numba") is not None
_lock = threading.Lock()
_kernels: dict[int, object] = {}  # rows each kernel multiplies -> the compiled kernel
_OUTPUTS_PER_PASS = {4: 4, 8: 3}  # each kernel's outputs per pass (its rows -> them)
numba = None  # the module, once imported: the kernels read its prange when numba compiles them


def available() -> bool:
    """Whether numba is installed (a Linux dependency; a Mac's GPU never runs the CPU's kernels). It is
    imported at the first compile, not with tinymlx (0.5 s)."""
    return _NUMBA_INSTALLED


def times(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [rows, in] (2 to MAX_ROWS rows) @ weight.T, weight [out, in] C-contiguous: [rows, out] float32."""
    rows, n = x.shape[0], weight.shape[0]
    width = 4 if rows <= 4 else 8
    padded = np.zeros((width, x.shape[1]), dtype=np.float32)  # missing rows cost no extra read of W
    padded[:rows] = x
    out = np.empty((width, n), dtype=np.float32)
    with _lock:
        _compiled(width)(padded, weight, out)
    done = n - n % _OUTPUTS_PER_PASS[width]
    out[:, done:] = padded @ weight[done:].T  # the last outputs of a width not a multiple of a pass
    return out[:rows]


def warm_up() -> None:
    """Compile now (a load calls this), not in the first step that needs a kernel: 1-2 s the first time on
    a machine, then ~0.2 s from numba's cache (measured)."""
    if available():
        for rows in (2, 5):
            times(np.zeros((rows, 4), dtype=np.float32), np.zeros((5, 4), dtype=np.float32))


def _compiled(width: int):
    global numba
    if width not in _kernels:
        import numba

        # numba's default OpenMP threads spin after each kernel, and so do BLAS's after each product: between
        # MLX's sgemms the kernel read 4.7 GB/s against 24 alone (measured). The workqueue's threads sleep.
        numba.config.THREADING_LAYER = "workqueue"
        # reassoc: the sums may be split across SIMD lanes (float32 rounding, as BLAS's own order differs)
        _kernels[width] = numba.njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)(
            _four_rows if width == 4 else _eight_rows)
    return _kernels[width]


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


def _eight_rows(x, weight, out):  # pragma: no cover - compiled by numba
    """out[r, j] = x[r] . weight[j] for x [8, in], weight [out, in]: three outputs of eight rows per pass
    (24 sums: more spill out of the registers)."""
    n, k_size = weight.shape
    x0, x1, x2, x3, x4, x5, x6, x7 = x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]
    for block in numba.prange(n // 3):
        j = 3 * block
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0.0)
        c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = np.float32(0.0)
        for k in range(k_size):
            wa, wb, wc = weight[j, k], weight[j + 1, k], weight[j + 2, k]
            v = x0[k]
            a0, b0, c0 = a0 + v * wa, b0 + v * wb, c0 + v * wc
            v = x1[k]
            a1, b1, c1 = a1 + v * wa, b1 + v * wb, c1 + v * wc
            v = x2[k]
            a2, b2, c2 = a2 + v * wa, b2 + v * wb, c2 + v * wc
            v = x3[k]
            a3, b3, c3 = a3 + v * wa, b3 + v * wb, c3 + v * wc
            v = x4[k]
            a4, b4, c4 = a4 + v * wa, b4 + v * wb, c4 + v * wc
            v = x5[k]
            a5, b5, c5 = a5 + v * wa, b5 + v * wb, c5 + v * wc
            v = x6[k]
            a6, b6, c6 = a6 + v * wa, b6 + v * wb, c6 + v * wc
            v = x7[k]
            a7, b7, c7 = a7 + v * wa, b7 + v * wb, c7 + v * wc
        for r, (a, b, c) in enumerate(((a0, b0, c0), (a1, b1, c1), (a2, b2, c2), (a3, b3, c3), (a4, b4, c4),
                                       (a5, b5, c5), (a6, b6, c6), (a7, b7, c7))):
            out[r, j], out[r, j + 1], out[r, j + 2] = a, b, c
