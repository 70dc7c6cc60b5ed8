"""What the device lets the engine hold. On a Mac's GPU, Metal's recommended working set: the most memory it
may wire, which the weights and the engine's pools must fit under together. Past it, macOS pages GPU memory
out or the machine panics, a failure mlx-lm users report again and again. Elsewhere no such limit is known.

`hold_working_set` raises MLX's wired limit to that working set while an engine lives, as mlx-lm's
`wired_limit` does around a generation, so that the weights and pools stay resident; `release_working_set`
puts the previous limit back."""

from __future__ import annotations

import mlx.core as mx


def working_set_bytes() -> int | None:
    """Metal's `max_recommended_working_set_size`; None on the CPU, or on a GPU that does not report one."""
    if mx.default_device().type != mx.gpu:
        return None
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    size = info.get("max_recommended_working_set_size")
    return int(size) if size else None


def hold_working_set() -> int | None:
    """Wire up to the working set; the limit it replaced (None: nothing changed, no working set known)."""
    size = working_set_bytes()
    return None if size is None else mx.set_wired_limit(size)


def release_working_set(previous: int | None) -> None:
    if previous is not None:
        mx.synchronize()  # nothing in flight may lose its wired buffers
        mx.set_wired_limit(previous)
