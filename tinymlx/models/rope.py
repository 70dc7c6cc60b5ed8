"""Rotary position embeddings for flat token batches: plain, linear, llama3 and yarn, one per layer type."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

SUPPORTED = ("default", "linear", "llama3", "yarn", "proportional")


class RoPE:
    """mx.fast.rope with one position per token. Not an nn.Module: it holds no weights, and its
    frequencies stay float32 whatever dtype the model is cast to."""

    def __init__(self, dims: int, theta: float, scaling: dict[str, Any] | None = None,
                 max_position_embeddings: int = 32768):
        self.dims = dims
        self.base: float | None = theta
        self.scale, self.freqs, self.attention_factor = 1.0, None, 1.0
        kind = (scaling or {}).get("rope_type", "default")
        if kind == "linear":
            self.scale = 1.0 / scaling["factor"]
        elif kind == "llama3":
            self.base, self.freqs = None, _llama3_freqs(dims, theta, scaling)
        elif kind == "yarn":
            self.base = None
            self.freqs, self.attention_factor = _yarn(dims, theta, scaling, max_position_embeddings)
        elif kind == "proportional":  # Gemma 4's global layers: the first pairs rotate, the rest keep still
            self.base, self.freqs = None, _proportional_freqs(dims, theta, scaling)
        elif kind != "default":
            raise ValueError(f"unsupported RoPE type {kind!r} (supported: {', '.join(SUPPORTED)})")
        if self.freqs is not None:  # computed now, on this thread: a tensor-parallel step runs on another,
            mx.eval(self.freqs)  # where a graph built on this one's stream cannot be evaluated

    @property
    def periods(self) -> mx.array:
        """[dims / 2] the positions over which each rotated pair turns one radian, as mx.fast.rope reads its
        arguments: base ** (2i / dims), or the freqs, over the scale."""
        wavelengths = self.freqs if self.freqs is not None else self.base ** (mx.arange(0, self.dims, 2) / self.dims)
        return wavelengths / self.scale

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """x [N, heads, head_dim] rotated to `positions` [N]."""
        if self.attention_factor != 1.0:  # yarn scales cos and sin, i.e. q and k, by this factor
            x = x * self.attention_factor
        # mx.fast.rope rotates along axis -2 from `offset`; a length-1 axis there with one
        # offset per token gives every token of every sequence its own position.
        rotated = mx.fast.rope(x[:, :, None, :], self.dims, traditional=False, base=self.base,
                               scale=self.scale, offset=positions, freqs=self.freqs)
        return rotated[:, :, 0, :]


def _proportional_freqs(dims: int, theta: float, scaling: dict[str, Any]) -> mx.array:
    """transformers' "proportional": partial_rotary_factor of the head's pairs rotate at theta's wavelengths
    over the whole head_dim (not over the rotated part), the others never (an infinite wavelength)."""
    angles = int(scaling.get("partial_rotary_factor", 1.0) * dims // 2)
    rotated = scaling.get("factor", 1.0) * theta ** (mx.arange(0, 2 * angles, 2, dtype=mx.float32) / dims)
    return mx.concatenate([rotated, mx.full((dims // 2 - angles,), mx.inf)])


def _llama3_freqs(dims: int, theta: float, scaling: dict[str, Any]) -> mx.array:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    freqs = theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > old_context / low, freqs * factor, freqs)
    smooth = (old_context / wavelens - low) / (high - low)
    smoothed = freqs / ((1 - smooth) / factor + smooth)
    is_medium = (wavelens > old_context / high) & (wavelens < old_context / low)
    return mx.where(is_medium, smoothed, freqs)


def _yarn(dims: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int) -> tuple[mx.array, float]:
    """(wavelength per rotated pair, attention factor) as transformers computes them."""
    old_context = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor") or max_position_embeddings / old_context
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dims * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / ((high - low) or 0.001), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: interpolate it by `factor`
    inv_freq = 1.0 / theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return 1.0 / inv_freq, float(attention_factor)


class MRoPE:
    """Qwen2-VL's multimodal RoPE: positions [3, N] (temporal, height, width); the head's rotated pairs take
    their angle from one of the three, in `sections` (pairs per component, in that order), as transformers'
    apply_multimodal_rotary_pos_emb does. Each component rotates the whole head through mx.fast.rope and
    each pair keeps its own component's result: a pair's rotation depends on its angle alone.

    `interleaved` (Qwen3-VL, Qwen3.5): the components take turns pair by pair, t h w t h w ..., as
    transformers' recomposition_frequencies assigns them: pair j turns with the height where j % 3 == 1
    and j < 3 * sections[1], with the width where j % 3 == 2 and j < 3 * sections[2], else with the time.
    `head_dim` > `dims` (Qwen3.5): only the first `dims` of each head rotate, the rest pass unchanged."""

    def __init__(self, dims: int, theta: float, sections: tuple[int, ...], interleaved: bool = False,
                 head_dim: int | None = None):
        # Interleaved sections need not add up: transformers strides through whatever pairs there are (a
        # config's default [11, 11, 10] on a small head still loads).
        if len(sections) != 3 or (not interleaved and sum(sections) != dims // 2):
            raise ValueError(f"mrope_section {list(sections)} must give 3 counts of rotated pairs adding up to "
                             f"head_dim / 2 = {dims // 2}")
        self.dims, self.theta = dims, theta
        if interleaved:
            pair = mx.arange(dims // 2)
            is_height = (pair % 3 == 1) & (pair < 3 * sections[1])
            is_width = (pair % 3 == 2) & (pair < 3 * sections[2])
            pair_component = mx.where(is_height, 1, mx.where(is_width, 2, 0))
        else:
            pair_component = mx.concatenate([mx.full((n,), i) for i, n in enumerate(sections)])
        still = mx.zeros(((head_dim or dims) - dims,), dtype=pair_component.dtype)  # any component: unrotated
        self.component = mx.concatenate([pair_component, pair_component, still])  # [head_dim]: rotate_half's layout
        mx.eval(self.component)

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """x [N, heads, head_dim] rotated to `positions` [3, N] (or [N]: text, all three alike)."""
        if positions.ndim == 1:
            return _rope(x, self.dims, self.theta, positions)
        t, h, w = (_rope(x, self.dims, self.theta, positions[i]) for i in range(3))
        return mx.where(self.component == 0, t, mx.where(self.component == 1, h, w))


def _rope(x: mx.array, dims: int, theta: float, positions: mx.array) -> mx.array:
    return mx.fast.rope(x[:, :, None, :], dims, traditional=False, base=theta, scale=1.0, offset=positions)[:, :, 0, :]
