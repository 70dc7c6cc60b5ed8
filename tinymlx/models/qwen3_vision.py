"""The vision tower of Qwen3-VL (qwen3_vl, qwen3_vl_moe) and Qwen3.5 (qwen3_5, qwen3_5_moe): one ViT for all
four, which differ only in DeepStack (Qwen3-VL has it; Qwen3.5's tower drops it).

    pixel_values [patches, C*T*p*p], patches in spatial-merge-block order (each m x m block consecutive)
      -> patch_embed (the Conv3d as a matmul) + learned position table resampled bilinearly to the grid
      -> blocks: x + attn(LayerNorm(x)) with 2D rotary (rows, columns), x + MLP(LayerNorm(x));
         attention stays within each frame of each image
      -> merger: LayerNorm, m x m neighbours concatenated, MLP -> [patches / m^2, out_hidden_size]
      DeepStack (Qwen3-VL): after block `deepstack_visual_indexes[i]` a merger of its own (LayerNorm after
      the concatenation) gives level i, which the text model adds to the image tokens after its layer i.

Weights keep Hugging Face's names under the tower (`model.visual.*` in Hugging Face's checkpoints,
`visual.*` in older ones, `vision_tower.*` in mlx-vlm's, whose conv weight is channels-last).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tinymlx.ops import kernels

_PREFIXES = ("model.visual.", "visual.", "vision_tower.")
_WITHOUT_DEEPSTACK = ("qwen3_5", "qwen3_5_moe")  # Hugging Face's Qwen3.5 tower ignores deepstack_visual_indexes
_ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}
Grid = tuple[int, int, int]


@dataclass(frozen=True)
class VisionArgs:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0
    deepstack_visual_indexes: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionArgs:
        vision = config["vision_config"]
        fields = {name: vision[name] for name in cls.__dataclass_fields__ if name in vision}
        rope_theta = vision.get("rope_theta", cls.rope_theta)  # transformers 5 nests it in rope_parameters
        fields["rope_theta"] = (vision.get("rope_parameters") or {}).get("rope_theta", rope_theta)
        deepstack = () if config.get("model_type") in _WITHOUT_DEEPSTACK else vision.get("deepstack_visual_indexes")
        fields["deepstack_visual_indexes"] = tuple(deepstack or ())
        if fields.get("hidden_act", cls.hidden_act) not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {fields['hidden_act']!r}")
        return cls(**fields)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def _rotated(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate-half RoPE in float32, as Hugging Face applies it, back in x's dtype."""
    x32 = x.astype(mx.float32)
    first, second = mx.split(x32, 2, axis=-1)
    return (x32 * cos + mx.concatenate([-second, first], axis=-1) * sin).astype(x.dtype)


class VisionAttention(nn.Module):
    """Multi-head attention with 2D rotary, run separately on each frame: images never see each other."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.num_heads, self.scale = args.num_heads, args.head_dim**-0.5
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, frames: Sequence[tuple[int, int]]) -> mx.array:
        N, D = x.shape
        qkv = self.qkv(x).reshape(N, 3, self.num_heads, -1)
        q, k, v = _rotated(qkv[:, 0], cos, sin), _rotated(qkv[:, 1], cos, sin), qkv[:, 2]
        outputs, start = [], 0
        for num_frames, frame_len in frames:  # one image's frames as a batch: [t, heads, h*w, head_dim]
            end = start + num_frames * frame_len
            q_i, k_i, v_i = (t[start:end].reshape(num_frames, frame_len, self.num_heads, -1).transpose(0, 2, 1, 3)
                             for t in (q, k, v))
            out = kernels.dense_attention(q_i, k_i, v_i, self.scale)
            outputs.append(out.transpose(0, 2, 1, 3).reshape(end - start, D))
            start = end
        return self.proj(mx.concatenate(outputs) if len(outputs) > 1 else outputs[0])


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = _ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, frames: Sequence[tuple[int, int]]) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each m x m block of patches (consecutive rows) to one token. The main merger normalises each patch
    first; DeepStack's (`after_concat`) normalise the concatenated block."""

    def __init__(self, args: VisionArgs, after_concat: bool = False):
        super().__init__()
        self.merged_size = args.hidden_size * args.spatial_merge_size**2
        self.after_concat = after_concat
        self.norm = nn.LayerNorm(self.merged_size if after_concat else args.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, args.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        if self.after_concat:
            x = self.norm(x.reshape(-1, self.merged_size))
        else:
            x = self.norm(x).reshape(-1, self.merged_size)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """The Conv3d over one patch (kernel = stride = patch) is a matmul on the flattened patch."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.proj = nn.Linear(args.patch_dim, args.hidden_size)

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches)


class VisionTower(nn.Module):
    """Qwen3-VL / Qwen3.5's ViT: pixel patches of any number of images to their tokens' embeddings, the
    merger's then each DeepStack level's, side by side, so one array per image can be cached as one."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = [VisionBlock(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args)
        self.deepstack_merger_list = [PatchMerger(args, after_concat=True) for _ in args.deepstack_visual_indexes]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionTower:
        """From a checkpoint's whole config.json (its `vision_config`, and `model_type` for DeepStack)."""
        return cls(VisionArgs.from_config(config))

    @property
    def num_deepstack_levels(self) -> int:
        return len(self.args.deepstack_visual_indexes)

    def __call__(self, pixel_values: mx.array, grid_thw: Sequence[Grid]) -> mx.array:
        """[sum of t*h*w / m^2, out_hidden_size * (1 + num_deepstack_levels)], images in order."""
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
        coordinates = [_patch_coordinates(grid, self.args.spatial_merge_size) for grid in grids]
        rows, cols = (mx.concatenate([c[axis] for c in coordinates]) for axis in (0, 1))
        positions = mx.concatenate([self._positions(r, c, h, w) for (r, c), (_, h, w) in zip(coordinates, grids)])
        x = self.patch_embed(pixel_values.astype(self.patch_embed.proj.weight.dtype))
        x = x + positions.astype(x.dtype)
        cos, sin = self._rotary(rows, cols)
        frames = [(t, h * w) for t, h, w in grids]
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.args.deepstack_visual_indexes:
                levels.append(self.deepstack_merger_list[self.args.deepstack_visual_indexes.index(i)](x))
        return mx.concatenate([self.merger(x), *levels], axis=-1) if levels else self.merger(x)

    def _positions(self, rows: mx.array, cols: mx.array, height: int, width: int) -> mx.array:
        """The learned square table resampled to a height x width grid (bilinear, corners aligned: Hugging
        Face's F.interpolate-equivalent gather), four taps per patch."""
        side = int(self.args.num_position_embeddings**0.5)
        row_taps, row_weights = _taps(rows, height, side)
        col_taps, col_weights = _taps(cols, width, side)
        taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4, 1)
        return (self.pos_embed(taps) * weights).sum(axis=1)  # float32 weights, as Hugging Face sums them

    def _rotary(self, rows: mx.array, cols: mx.array) -> tuple[mx.array, mx.array]:
        """cos, sin [patches, 1, head_dim]: a quarter of the frequencies turn with the row, a quarter with
        the column, and the second half of the head repeats the first (rotate-half layout)."""
        half = self.args.head_dim // 2
        inv_freq = 1.0 / (self.args.rope_theta ** (mx.arange(0, half, 2, dtype=mx.float32) / half))
        angles = mx.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1)
        angles = mx.concatenate([angles, angles], axis=-1)[:, None, :]
        return mx.cos(angles), mx.sin(angles)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The tower's tensors out of a whole checkpoint, named as this module tree; the Conv3d's weight
        becomes the patch matmul's [hidden, C*T*p*p] (C first, as the processor flattens a patch)."""
        tower = {}
        for name, value in weights.items():
            prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                tower[name[len(prefix):]] = value
        conv = tower.get("patch_embed.proj.weight")
        if conv is not None and conv.ndim == 5:
            a = self.args
            if conv.shape[1:] != (a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size):
                conv = conv.moveaxis(-1, 1)  # mlx-vlm's channels-last Conv3d: [out, T, p, p, C]
            tower["patch_embed.proj.weight"] = conv.reshape(conv.shape[0], -1)
        return tower


def _patch_coordinates(grid: Grid, merge: int) -> tuple[mx.array, mx.array]:
    """Each patch's (row, column) in its frame, in the processor's order: m x m blocks row by row, the
    patches of a block row by row, every frame alike."""
    t, h, w = grid
    shape = (t, h // merge, w // merge, merge, merge)
    rows = mx.broadcast_to(mx.arange(h).reshape(1, h // merge, 1, merge, 1), shape).reshape(-1)
    cols = mx.broadcast_to(mx.arange(w).reshape(1, 1, w // merge, 1, merge), shape).reshape(-1)
    return rows, cols


def _taps(index: mx.array, size: int, side: int) -> tuple[mx.array, mx.array]:
    """The two table rows an axis position reads, and their weights: position i of `size` sits at
    i * (side - 1) / (size - 1) in the table (corners aligned); the upper tap is clamped to the table."""
    source = index.astype(mx.float32) * (side - 1) / max(size - 1, 1)
    lower = mx.floor(source)
    fraction = source - lower
    lower = lower.astype(mx.int32)
    taps = mx.stack([lower, mx.minimum(lower + 1, side - 1)], axis=-1)
    return taps, mx.stack([1 - fraction, fraction], axis=-1)
