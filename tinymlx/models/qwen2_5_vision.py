"""Qwen2.5-VL's vision tower: patches -> (window | full) attention blocks -> 2x2 patch merger -> LM tokens.

Patches arrive as HF's processor orders them: per frame, merge-unit by merge-unit (each unit: the
merge x merge patches that become one LM token, row-major). The tower first reorders whole units so each
attention window (window_size pixels square, cut at the image's edges) is contiguous, runs every block in
that order, and merges units back to the processor's order at the end:

    units of a 5 x 7 grid, window 2 x 2 units      window order
     0  1 |  2  3 |  4  5 |  6                      0 1 7 8 | 2 3 9 10 | 4 5 11 12 | 6 13 | 14 15 21 22 | ...
     7  8 |  9 10 | 11 12 | 13
    ------+-------+-------+---
    14 15 | 16 17 | ...

Window blocks attend inside one window, full blocks (`fullatt_block_indexes`) inside one frame; attention
never crosses images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tinymlx.models.layers import RMSNorm, activation
from tinymlx.models.vision_layers import Segments, rope_2d

CHECKPOINT_PREFIXES = ("visual.", "model.visual.")  # transformers 5 saves visual.*; older layouts model.visual.*
NORM_EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class VisionArgs:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionArgs:
        """From a checkpoint's whole config.json (its `vision_config`)."""
        vision = config.get("vision_config", config)
        fields = {name: vision[name] for name in cls.__dataclass_fields__ if name in vision}
        fields["in_channels"] = vision.get("in_channels", vision.get("in_chans", 3))
        fields["fullatt_block_indexes"] = tuple(vision.get("fullatt_block_indexes", cls.fullatt_block_indexes))
        fields["rope_theta"] = (vision.get("rope_parameters") or {}).get("rope_theta",
                                                                         vision.get("rope_theta", 10000.0))
        return cls(**fields)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def units_per_window(self) -> int:
        """A window's side in merge units."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclass(frozen=True, eq=False)
class WindowLayout:
    """Where each patch goes for one call's images, computed on the host from the grids alone.

    `patch_order`: processor order -> window order (whole merge units move); `unit_inverse`: merged tokens
    back to processor order; `positions` [N, 2]: each patch's (row, column) in its frame, in window order;
    `windows` / `frames`: the window and full blocks' attention segments."""

    patch_order: mx.array
    unit_inverse: mx.array
    positions: mx.array
    windows: Segments
    frames: Segments

    @classmethod
    def build(cls, grid_thw: Sequence[tuple[int, int, int]], merge: int, units_per_window: int) -> WindowLayout:
        unit_order, window_lengths, frame_lengths, positions = [], [], [], []
        first_unit = 0
        for t, h, w in grid_thw:
            rows, cols = h // merge, w // merge
            units = first_unit + np.arange(t * rows * cols).reshape(t, rows, cols)
            for frame in units:
                for top in range(0, rows, units_per_window):
                    for left in range(0, cols, units_per_window):
                        window = frame[top:top + units_per_window, left:left + units_per_window].reshape(-1)
                        unit_order.append(window)
                        window_lengths.append(window.size * merge * merge)
            frame_lengths += [h * w] * t
            # (row, column) of each patch in processor order: [rows, merge, cols, merge] read unit by unit.
            row_ids = np.broadcast_to(np.arange(h).reshape(rows, merge, 1, 1), (rows, merge, cols, merge))
            col_ids = np.broadcast_to(np.arange(w).reshape(1, 1, cols, merge), (rows, merge, cols, merge))
            frame_positions = np.stack([ids.transpose(0, 2, 1, 3).reshape(-1) for ids in (row_ids, col_ids)], -1)
            positions += [frame_positions] * t
            first_unit += t * rows * cols
        units = np.concatenate(unit_order)
        patch_order = (units[:, None] * merge * merge + np.arange(merge * merge)).reshape(-1)
        return cls(patch_order=mx.array(patch_order, dtype=mx.int32),
                   unit_inverse=mx.array(np.argsort(units), dtype=mx.int32),
                   positions=mx.array(np.concatenate(positions)[patch_order], dtype=mx.int32),
                   windows=Segments.from_lengths(window_lengths), frames=Segments.from_lengths(frame_lengths))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one patch) is a matmul on the flattened patches."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        patch_values = args.in_channels * args.temporal_patch_size * args.patch_size**2
        self.proj = nn.Linear(patch_values, args.hidden_size, bias=False)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        return self.proj(pixel_values)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.num_heads, self.head_dim, self.rope_theta = args.num_heads, args.head_dim, args.rope_theta
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def __call__(self, x: mx.array, positions: mx.array, segments: Segments) -> mx.array:
        N, _ = x.shape
        qkv = self.qkv(x).reshape(N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = rope_2d(q, positions, self.rope_theta), rope_2d(k, positions, self.rope_theta)
        out = segments.attend(q, k, v, self.head_dim**-0.5)
        return self.proj(out.reshape(N, -1))


class VisionMLP(nn.Module):
    """A gated MLP with biases: down(act(gate(x)) * up(x))."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)
        self.act = activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class VisionBlock(nn.Module):
    """Pre-norm: h = x + attn(norm1(x)); out = h + mlp(norm2(h)); `is_full` attends over whole frames."""

    def __init__(self, args: VisionArgs, is_full: bool):
        super().__init__()
        self.is_full = is_full
        self.norm1 = RMSNorm(args.hidden_size, NORM_EPS)
        self.norm2 = RMSNorm(args.hidden_size, NORM_EPS)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args)

    def __call__(self, x: mx.array, layout: WindowLayout) -> mx.array:
        segments = layout.frames if self.is_full else layout.windows
        h = x + self.attn(self.norm1(x), layout.positions, segments)
        return h + self.mlp(self.norm2(h))


class PatchMerger(nn.Module):
    """Each merge unit's patches (consecutive rows), normed and concatenated, to one LM token."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.unit_dim = unit_dim = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = RMSNorm(args.hidden_size, NORM_EPS)
        self.mlp = [nn.Linear(unit_dim, unit_dim), nn.GELU(), nn.Linear(unit_dim, args.out_hidden_size)]

    def __call__(self, x: mx.array) -> mx.array:
        x = self.ln_q(x).reshape(-1, self.unit_dim)
        for layer in self.mlp:
            x = layer(x)
        return x


class VisionTower(nn.Module):
    """pixel_values [sum of t*h*w, C*T*p*p] of images in order, with their (t, h, w) patch grids ->
    [sum of t*h*w / merge^2, out_hidden_size]: each image's LM tokens, in order."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = [VisionBlock(args, i in args.fullatt_block_indexes) for i in range(args.depth)]
        self.merger = PatchMerger(args)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionTower:
        return cls(VisionArgs.from_config(config))

    def __call__(self, pixel_values: mx.array, grid_thw: Sequence[tuple[int, int, int]]) -> mx.array:
        grid_thw = [tuple(int(n) for n in grid) for grid in grid_thw]
        self._check(pixel_values, grid_thw)
        layout = WindowLayout.build(grid_thw, self.args.spatial_merge_size, self.args.units_per_window)
        h = self.patch_embed(pixel_values.astype(self.dtype))[layout.patch_order]
        for block in self.blocks:
            h = block(h, layout)
        return self.merger(h)[layout.unit_inverse]

    @property
    def dtype(self) -> mx.Dtype:
        """The tower's float dtype, read from a norm: a quantized or CPU linear's weight is no guide, and
        float32 pixels would otherwise promote a bfloat16 tower's whole path to float32."""
        return self.merger.ln_q.weight.dtype

    def _check(self, pixel_values: mx.array, grid_thw: list[tuple[int, ...]]) -> None:
        merge = self.args.spatial_merge_size
        if any(len(grid) != 3 or grid[1] % merge or grid[2] % merge for grid in grid_thw):
            raise ValueError(f"grids must be (t, h, w) with h and w multiples of {merge}, got {grid_thw}")
        num_patches = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.ndim != 2 or pixel_values.shape[0] != num_patches:
            raise ValueError(f"pixel_values {pixel_values.shape} should have {num_patches} rows for {grid_thw}")

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The tower's tensors among a whole checkpoint's, under this module's names; the Conv3d weight
        [E, C, T, p, p] flattened to the linear's [E, C*T*p*p] (C, T, p, p is the pixel rows' order)."""
        tower = {}
        for name, weight in weights.items():
            prefix = next((p for p in CHECKPOINT_PREFIXES if name.startswith(p)), None)
            if prefix is None:
                continue
            name = name[len(prefix):]
            if name == "patch_embed.proj.weight" and weight.ndim == 5:
                weight = weight.reshape(weight.shape[0], -1)
            tower[name] = weight
        return tower
