"""A GGUF's quantized blocks as MLX's affine quantization, without a float round trip (dtype="native").

MLX's format, per group of GROUP_SIZE weights along a row: w = scale * q + bias, q an unsigned
`bits`-bit code, packed least-significant bit first into uint32 words (8 codes fill `bits` bytes).
Each llama.cpp block stores, per group of 32, a float16 d (and m or a 6-bit scale and min under a
super-block's d / dmin), so most types are a change of layout:

    type   llama.cpp's weight            bits  scale      bias        exact
    Q8_0   d * q       (q int8)            8   d          -128 d      yes
    Q4_0   d * (q - 8)                     4   d          -8 d        yes
    Q4_1   d * q + m                       4   d          m           yes
    Q5_0   d * (q - 16)                    5   d          -16 d       yes
    Q5_1   d * q + m                       5   d          m           yes
    Q4_K   d*sc * q - dmin*mn  (per 32)    4   d*sc       -dmin*mn    yes
    Q5_K   d*sc * q - dmin*mn  (per 32)    5   d*sc       -dmin*mn    yes
    other  (Q6_K, Q3_K, Q2_K, IQ*, ...)    8   from gguf-py's exact dequantization: see _requantize8

"yes": MLX's dequantization (scale * q + bias in float32, as quantized_matmul computes it) gives
gguf-py's float32 dequantization bit for bit: every scale * q is exact in float32, so a fused
multiply-add rounds as gguf-py's two steps do.

Scales and biases are float16 for the _0/_1 types, whose d, m and -128 d are float16s (exact, half the
bytes), and for the requantized ones; Q4_K/Q5_K's d*sc has up to 17 significant bits, so theirs stay
float32 (a float16 copy would be up to 0.0004 off on the 0.5B: half of 1% of a step).

MXFP4 (gpt-oss's experts) is MLX's own "mxfp4" mode: the same 4-bit E2M1 codes and e8m0 scales per 32
(llama.cpp's values are twice E2M1's and its scale half of 2^(e-127): the same products), only the
codes' order in a block differs. It maps exactly, with no biases (`mxfp4_to_mlx`).

Q6_K's 16-wide sub-blocks with int8 scales fit no MLX group (32 is the smallest; a group of 32 holds
two sub-blocks whose scales differ, which only 4.6% of the 0.5B's groups could hold exactly in 8 bits),
so Q6_K, like every other type gguf-py dequantizes, is rounded from its exact dequantization to 8 bits
per group of 32, on float16 scales and biases: at most about (max - min) / 510 off (see _requantize8).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

GROUP_SIZE = 32
FLOAT_TYPES = {GGMLQuantizationType.F32: "F32", GGMLQuantizationType.F16: "F16", GGMLQuantizationType.BF16: "BF16"}
REQUANTIZED_BITS = 8
# The largest |MLX's dequantization - gguf-py's| by type, as a fraction of the group's range (max - min):
# 0 where the format maps exactly (see _requantize8 for the float16 rounding on top). Asserted by
# tests/test_gguf_native.py; measured on Qwen2.5-Coder's Q6_K tensors: 0.0027 (0.5B), 0.0054 (1.5B).
MAX_ERROR = {"Q8_0": 0.0, "Q4_0": 0.0, "Q4_1": 0.0, "Q5_0": 0.0, "Q5_1": 0.0, "Q4_K": 0.0, "Q5_K": 0.0,
             "Q6_K": 1 / 510, "Q3_K": 1 / 510, "Q2_K": 1 / 510, "IQ4_NL": 1 / 510, "IQ4_XS": 1 / 510}
_CHUNK = 1 << 21  # weights converted at a time: bounds the temporaries (about 40 bytes a weight)


class NativeTensor(NamedTuple):
    weight: np.ndarray  # uint32 [..., in * bits / 32]
    scales: np.ndarray  # float16 or float32 [..., in / 32]
    biases: np.ndarray  # as scales
    bits: int


def native_bits(qtype: GGMLQuantizationType) -> int | None:
    """The bits a tensor of this type becomes; None for the float types, which stay float."""
    if qtype in FLOAT_TYPES:
        return None
    if qtype == GGMLQuantizationType.MXFP4:
        return 4
    return _DIRECT[qtype][0] if qtype in _DIRECT else REQUANTIZED_BITS


def native_shapes(shape: tuple[int, ...], bits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The packed weight's shape and the scales' (and biases') shape for a [..., in] tensor."""
    *outer, cols = shape
    return (*outer, cols * bits // 32), (*outer, cols // GROUP_SIZE)


def to_native(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> NativeTensor:
    """GGUF tensor bytes (a GGUFReader tensor's `data`: uint8, one row of blocks per row) of `shape`
    (slowest dimension first) in MLX's packed affine layout."""
    bits = native_bits(qtype)
    if bits is None:
        raise ValueError(f"{qtype.name} is a float type: it is not quantized")
    *outer, cols = shape
    if cols % GROUP_SIZE:
        raise ValueError(f"rows of {cols} weights do not split into groups of {GROUP_SIZE}")
    rows = math.prod(outer)
    raw = np.asarray(data).view(np.uint8).reshape(rows, -1)
    weight_shape, scale_shape = native_shapes((rows, cols), bits)
    weight = np.empty(weight_shape, np.uint32)
    scales, biases = np.empty(scale_shape, np.float32), np.empty(scale_shape, np.float32)
    step = max(1, _CHUNK // cols)
    for start in range(0, rows, step):
        part = slice(start, start + step)
        codes, scales[part], biases[part] = _codes(raw[part], qtype, cols)
        weight[part] = _pack(codes, bits)
    if scales_dtype(qtype) == np.float16:  # half the bytes, the same values
        scales, biases = _to_float16(scales), _to_float16(biases)
    weight_shape, scale_shape = native_shapes(shape, bits)
    return NativeTensor(weight.reshape(weight_shape), scales.reshape(scale_shape), biases.reshape(scale_shape), bits)


def mxfp4_to_mlx(data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 blocks of `shape` (each: an e8m0 scale byte, then 16 bytes holding element j in byte j's low
    nibble and element j + 16 in its high one) -> MLX's mxfp4 (packed uint32 codes [..., in / 8], in order,
    low nibble first; uint8 scales [..., in / 32]): the same codes and scales, reordered."""
    *outer, cols = shape
    if cols % GROUP_SIZE:
        raise ValueError(f"rows of {cols} weights do not split into groups of {GROUP_SIZE}")
    blocks = np.asarray(data).view(np.uint8).reshape(-1, cols // GROUP_SIZE, 17)
    low, high = blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4
    codes = np.concatenate([low, high], axis=-1)  # [rows, blocks, 32], element order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    weight = np.ascontiguousarray(packed).reshape(-1, cols // 2).view("<u4")
    return weight.reshape(*outer, cols // 8), np.ascontiguousarray(blocks[..., 0]).reshape(*outer, cols // GROUP_SIZE)


def scales_dtype(qtype: GGMLQuantizationType) -> type:
    """float16 where every scale and bias of the type is a float16 (see above), else float32."""
    return np.float32 if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K) else np.float16


def _to_float16(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        narrow = values.astype(np.float16)
    if not (narrow.astype(np.float32) == values).all():  # -128 d beyond float16's range: d > 511
        raise ValueError("quantization scales beyond float16's range")
    return narrow


def _codes(raw: np.ndarray, qtype: GGMLQuantizationType, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of blocks -> codes uint8 [rows, cols], scales and biases float32 [rows, cols / 32]."""
    rows = raw.shape[0]
    if qtype in _DIRECT:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        codes, scales, biases = _DIRECT[qtype][1](raw.reshape(-1, type_size))
        return codes.reshape(rows, cols), scales.reshape(rows, -1), biases.reshape(rows, -1)
    values = quants.dequantize(raw, qtype).reshape(-1, GROUP_SIZE)
    codes, scales, biases = _requantize8(values)
    return codes.reshape(rows, cols), scales.reshape(rows, -1), biases.reshape(rows, -1)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low nibbles are the first 16 weights, the high ones the next 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32-bit mask: bit i is weight i's fifth bit, as a 0/16 addend."""
    return (np.unpackbits(qh, axis=-1, bitorder="little") << 4).astype(np.uint8)


def _q8_0(blocks):
    d = _f16(blocks, 0)
    return blocks[:, 2:] ^ np.uint8(0x80), d, -128 * d  # int8 q + 128, two's complement


def _q4_0(blocks):
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:]), d, -8 * d


def _q4_1(blocks):
    return _nibbles(blocks[:, 4:]), _f16(blocks, 0), _f16(blocks, 2)


def _q5_0(blocks):
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 6:]) | _high_bits(blocks[:, 2:6]), d, -16 * d


def _q5_1(blocks):
    return _nibbles(blocks[:, 8:]) | _high_bits(blocks[:, 4:8]), _f16(blocks, 0), _f16(blocks, 2)


def _k_scales(blocks):
    """A K-quant super-block's 8 sub-block scales d*sc and biases -dmin*mn, as gguf-py computes them."""
    sc, mn = quants.Q4_K.get_scale_min(blocks[:, 4:16])
    return _f16(blocks, 0) * sc.astype(np.float32), -(_f16(blocks, 2) * mn.astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 codes: each 32 bytes hold sub-block 2j in their low nibbles, 2j+1 in the high."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(blocks):
    scales, biases = _k_scales(blocks)
    return _k_nibbles(blocks[:, 16:144]), scales, biases


def _q5_k(blocks):
    scales, biases = _k_scales(blocks)
    qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _k_nibbles(blocks[:, 48:176]) | ((qh & 1) << 4), scales, biases


_DIRECT = {  # type: (bits, blocks [n, type size] -> codes, scales, biases)
    GGMLQuantizationType.Q8_0: (8, _q8_0), GGMLQuantizationType.Q4_0: (4, _q4_0),
    GGMLQuantizationType.Q4_1: (4, _q4_1), GGMLQuantizationType.Q5_0: (5, _q5_0),
    GGMLQuantizationType.Q5_1: (5, _q5_1), GGMLQuantizationType.Q4_K: (4, _q4_k),
    GGMLQuantizationType.Q5_K: (5, _q5_k),
}


def _requantize8(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups [G, 32] of exactly dequantized weights -> 8-bit codes, scales, biases: the nearest of 256
    levels from the group's min to its max, on float16s. The bias is the min rounded down to a float16
    and the scale (max - bias) / 255 rounded up to one, so the levels still cover the group: at most
    half a step off, (max - min + the bias's rounding) / 510 * (1 + 2^-10), plus float32 rounding."""
    lo, hi = values.min(axis=1, keepdims=True), values.max(axis=1, keepdims=True)
    biases = _float16_toward(lo, -np.inf)
    scales = _float16_toward((hi - biases) / np.float32(255), np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(scales > 0, (values - biases) / scales, 0)  # scale 0: every weight is the bias
    return np.clip(np.rint(codes), 0, 255).astype(np.uint8), scales, biases


def _float16_toward(values: np.ndarray, direction: float) -> np.ndarray:
    """float32 values rounded to a float16 on `direction`'s side (-inf: down, inf: up), as float32."""
    rounded = values.astype(np.float16)
    widened = rounded.astype(np.float32)
    beyond = widened > values if direction < 0 else widened < values
    rounded[beyond] = np.nextafter(rounded[beyond], np.float16(direction))
    if not np.isfinite(rounded).all():
        raise ValueError("weights beyond float16's range")
    return rounded.astype(np.float32)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [rows, cols] -> uint32 [rows, cols * bits / 32], least-significant bit first."""
    rows = codes.shape[0]
    if bits == 8:
        return np.ascontiguousarray(codes).view(np.uint32)
    if bits == 4:
        c = codes.reshape(rows, -1, 2)
        return np.ascontiguousarray(c[..., 0] | (c[..., 1] << 4)).view(np.uint32)
    assert bits == 5, bits
    c = [codes.reshape(rows, -1, 8)[..., i] for i in range(8)]  # 8 codes -> 5 bytes (uint8 shifts drop the overflow)
    packed = np.stack([c[0] | (c[1] << 5), (c[1] >> 3) | (c[2] << 2) | (c[3] << 7), (c[3] >> 1) | (c[4] << 4),
                       (c[4] >> 4) | (c[5] << 1) | (c[6] << 6), (c[6] >> 2) | (c[7] << 3)], axis=-1)
    return packed.reshape(rows, -1).view(np.uint32)
