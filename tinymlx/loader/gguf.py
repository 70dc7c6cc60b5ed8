"""Convert a GGUF file (any quant type) into a Hugging Face-format directory in the cache.

The directory holds config.json, generation_config.json, a model.safetensors with HF tensor names
(float32, or the 16-bit float the model is loaded in; or, for dtype="native", the file's own
quantization as MLX's packed weight/scales/biases with per-layer bits in config.json's
"quantization", as an MLX-quantized checkpoint has: see gguf_quant.py), tokenizer.json and
tokenizer_config.json, so the rest of tinymlx reads one format. What each architecture's tensors and metadata are called is
declared by its family (models/gguf_arch.py, collected in models/registry.py); this module only
reads, dequantizes, renames, undoes llama.cpp's storage tricks the family names, and writes. It is keyed by the file's identity and the stored dtype, and
built in a temp dir then renamed, so a second start reuses it and an interrupted conversion leaves
nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

from tinymlx.core.dtypes import resolve_dtype
from tinymlx.core.errors import ModelLoadError
from tinymlx.loader.gguf_file import GGUFFile, GGUFTensor, num_weights, read_gguf
from tinymlx.loader.gguf_quant import (
    GROUP_SIZE,
    mxfp4_to_mlx,
    native_bits,
    native_shapes,
    scales_dtype,
    to_native,
)
from tinymlx.loader.offline import cache_dir
from tinymlx.loader.progress import LoadProgress, ProgressCallback, StageMeter, ignore, progress_bar
from tinymlx.loader.weight_writer import WeightPlan, as_rows, entry_bytes, heads_in, write_weights
from tinymlx.models.gguf_arch import GGUFArch, Metadata
from tinymlx.models.registry import GGUF_ARCHITECTURES, gguf_arch_for
from tinymlx.text.tokenizer import gguf_tokenizer_files

ARCHITECTURES = tuple(GGUF_ARCHITECTURES)  # general.architecture values that convert
_VERSION = 1  # bump when the output changes, so older conversions are rebuilt
# Stored dtype -> (safetensors dtype, bytes per weight, directory-name suffix). float32 keeps the
# dequantized values exactly; a 16-bit copy is what a model loaded in 16 bits computes with anyway.
STORED_DTYPES = {"float32": ("F32", 4, ""), "bfloat16": ("BF16", 2, "-bf16"), "float16": ("F16", 2, "-f16")}
NATIVE_SUFFIX = "-native"  # the file's own quantization (no float copy of its quantized tensors)
SUFFIXES = {**{dtype: suffix for dtype, (_, _, suffix) in STORED_DTYPES.items()}, "native": NATIVE_SUFFIX}
# Reading a vocabulary token and building the tokenizer from it takes about as long as converting this many
# weights, so the convert stage counts it in its total: 15 us a token for gemma-3-270m's 262k sentencepiece
# tokens (merges rebuilt from the vocabulary), 4 us for Qwen2.5's 152k BPE ones; 7-13 ns a weight out.
_READ_WEIGHTS_PER_TOKEN = 1024


def stored_dtype(dtype: str | None, path: Path | None = None) -> str:
    """What a GGUF's converted copy keeps for a model loaded as `dtype` (None: float32, fits any):
    a float dtype of STORED_DTYPES, or "native".

    It is what load_model computes from, so loading loses nothing and the disk holds no bits the
    model drops: float32 on the CPU (BLAS's fast path), the file's quantization for "native" (which
    "auto" is on a GPU, and on a CPU whose RAM the float32 weights of the GGUF at `path` would crowd).
    """
    if dtype is None:
        return "float32"
    if dtype == "auto":
        dtype = resolve_dtype(dtype, None if path is None else 4 * num_weights(path))
    if dtype in SUFFIXES:
        return dtype
    return "float32" if mx.default_device() == mx.cpu else "bfloat16"  # q4/q8 quantize from this


def convert_gguf(
    path: str | Path, progress: bool = True, on_progress: ProgressCallback = ignore, dtype: str = "float32"
) -> Path:
    """The cached HF-format directory for a GGUF, its weights stored as `dtype` (see STORED_DTYPES; "native":
    its quantized tensors in MLX's layout, the float ones in float32)."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    if dtype not in SUFFIXES:
        raise ValueError(f"cannot store converted weights as {dtype!r} (choose from {', '.join(SUFFIXES)})")
    out = cache_dir() / "converted" / f"{path.stem}-{_identity(path)}{SUFFIXES[dtype]}"
    if (out / "config.json").is_file():  # only complete conversions are ever renamed into place
        return out
    on_progress(LoadProgress("convert", 0, 0))  # the total is known once the GGUF's index is read
    gguf_file = _open(path)
    meta = gguf_file.metadata
    arch = gguf_arch_for(meta.get("general.architecture"), f"{path}: ")
    names = {t.name: _hf_name(arch, t.name, path) for t in gguf_file.tensors}
    config = {**_config(arch, meta, gguf_file, path), "torch_dtype": "float32" if dtype == "native" else dtype}
    if dtype == "native":
        config["quantization"] = _native_quantization(gguf_file, names)
    plan = (_native_plan(arch, config, names, gguf_file) if dtype == "native"
            else _float_plan(arch, config, names, gguf_file, dtype))
    num_bytes = sum(entry_bytes(entry) for entries in plan.layout.values() for entry in entries)
    reading = _reading_bytes(meta, num_bytes, sum(t.n_elements for t in gguf_file.tensors))
    # Part of the total is notional (the reading), so the bar shows a fraction and the time, not bytes.
    bar = progress_bar(total=reading + num_bytes, desc=f"convert {path.name}", disable=not progress,
                       bar_format="{l_bar}{bar}| [{elapsed}<{remaining}]")
    with StageMeter("convert", reading + num_bytes, on_progress, bar) as meter:
        try:
            tokenizer, tokenizer_config, generation_config = gguf_tokenizer_files(meta)
        except (KeyError, ValueError) as error:
            raise ModelLoadError(f"{path}: cannot build its tokenizer: {error}") from None
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            tokenizer.save(str(tmp / "tokenizer.json"))
            for name, content in [
                ("config.json", config),
                ("tokenizer_config.json", tokenizer_config),
                ("generation_config.json", generation_config),
            ]:
                (tmp / name).write_text(json.dumps(content, indent=2, ensure_ascii=False))
            meter.advance(reading)
            write_weights(gguf_file.tensors, plan, tmp / "model.safetensors", meter)
            try:
                tmp.rename(out)
            except OSError:
                if not (out / "config.json").is_file():  # not merely a concurrent conversion that finished first
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _reading_bytes(meta: dict, num_bytes: int, num_weights: int) -> int:
    """Reading the GGUF and building its tokenizer, as the bytes out that take as long to convert."""
    num_tokens = len(meta.get("tokenizer.ggml.tokens", ()))
    return num_tokens * _READ_WEIGHTS_PER_TOKEN * num_bytes // max(num_weights, 1)


def _identity(path: Path) -> str:
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _open(path: Path) -> GGUFFile:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        return read_gguf(path)
    except Exception as error:  # a damaged file fails in many ways; all mean the same
        raise ModelLoadError(
            f"{path} is a corrupt or truncated GGUF file ({path.stat().st_size:,} bytes; {error}). "
            "Delete it and download it again."
        ) from None


def _hf_name(arch: GGUFArch, name: str, path: Path) -> str:
    hf_name = arch.hf_name(name)
    if hf_name is None:
        raise ModelLoadError(f"{path}: tensor {name!r} has no Hugging Face equivalent in {arch.name} checkpoints")
    return hf_name


def _config(arch: GGUFArch, meta: dict, gguf_file: GGUFFile, path: Path) -> dict:
    shapes = {t.name: t.numpy_shape for t in gguf_file.tensors}
    try:
        family = arch.config(Metadata(arch.name, meta, shapes))
    except KeyError as missing:
        what = "tensor" if str(missing.args[0]).endswith(".weight") else "metadata"
        raise ModelLoadError(f"{path}: GGUF {what} lacks {missing.args[0]}, which {arch.name} needs") from None
    return {"architectures": [arch.hf_architecture], "model_type": arch.model_type, **family}


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's Q/K rows for its pairwise RoPE; HF rotates halves. Undo it.
    pairs = weight.reshape(num_heads, weight.shape[0] // num_heads // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def _float_plan(arch: GGUFArch, config: dict, names: dict, gguf_file: GGUFFile, dtype: str) -> WeightPlan:
    st_dtype = STORED_DTYPES[dtype][0]
    layout = {t.name: [(names[t.name], st_dtype, t.numpy_shape)] for t in gguf_file.tensors}
    heads = _permuted(arch, config, gguf_file)

    def encode(tensor: GGUFTensor, rows: slice) -> list:
        return [_encode(np.ascontiguousarray(_float_rows(arch, heads, tensor, rows), dtype="<f4"), dtype)]

    return WeightPlan(layout, heads, encode)


MXFP4 = gguf.GGMLQuantizationType.MXFP4


def _native_plan(arch: GGUFArch, config: dict, names: dict, gguf_file: GGUFFile) -> WeightPlan:
    """Quantized tensors as MLX's <name>.weight (uint32), .scales and .biases (float16 or float32, see
    gguf_quant.py); the rest float32."""
    layout = {}
    for tensor in gguf_file.tensors:
        bits, name = _native_bits(tensor, names[tensor.name]), names[tensor.name]
        if bits is None:
            layout[tensor.name] = [(name, "F32", tensor.numpy_shape)]
        else:
            base = name.removesuffix(".weight")
            weight_shape, scale_shape = native_shapes(tensor.numpy_shape, bits)
            if tensor.tensor_type == MXFP4:  # MLX's mxfp4: e8m0 scales, no biases
                layout[tensor.name] = [(name, "U32", weight_shape), (f"{base}.scales", "U8", scale_shape)]
                continue
            scales = "F16" if scales_dtype(tensor.tensor_type) == np.float16 else "F32"
            layout[tensor.name] = [(name, "U32", weight_shape), (f"{base}.scales", scales, scale_shape),
                                   (f"{base}.biases", scales, scale_shape)]
    heads = _permuted(arch, config, gguf_file)

    def encode(tensor: GGUFTensor, rows: slice) -> list:
        if len(layout[tensor.name]) == 1:
            return [np.ascontiguousarray(_float_rows(arch, heads, tensor, rows), dtype="<f4").data.cast("B")]
        if tensor.tensor_type == MXFP4:  # (experts: never Q/K rows, which llama.cpp permutes)
            shape = (rows.stop - rows.start, tensor.numpy_shape[-1])
            return [part.data.cast("B") for part in mxfp4_to_mlx(as_rows(tensor)[rows], shape)]
        native = to_native(as_rows(tensor)[rows], tensor.tensor_type, (rows.stop - rows.start, tensor.numpy_shape[-1]))
        num_heads = heads_in(heads, tensor, rows)  # whole rows: of packed codes, scales and biases alike
        return [np.ascontiguousarray(part if num_heads is None else _unpermute(part, num_heads)).data.cast("B")
                for part in native[:3]]

    return WeightPlan(layout, heads, encode)


def _float_rows(arch: GGUFArch, heads: dict[str, int], tensor: GGUFTensor, rows: slice) -> np.ndarray:
    """Rows of a tensor's exact float32 dequantization, with the storage tricks the family names undone."""
    shape = tensor.numpy_shape
    weight = gguf.quants.dequantize(as_rows(tensor)[rows], tensor.tensor_type)
    weight = weight.reshape(shape if len(shape) == 1 else (-1, shape[-1]))  # a vector unpermutes along itself
    num_heads = heads_in(heads, tensor, rows)
    if num_heads is not None:
        weight = _unpermute(weight, num_heads)
    if arch.norm_shift and arch.is_norm(tensor.name):
        weight = weight.astype(np.float32) - np.float32(arch.norm_shift)
    return weight


def _permuted(arch: GGUFArch, config: dict, gguf_file: GGUFFile) -> dict[str, int]:
    return {t.name: heads for t in gguf_file.tensors if (heads := _permuted_heads(arch, config, t.name)) is not None}


def _permuted_heads(arch: GGUFArch, config: dict, name: str) -> int | None:
    """The head count whose Q/K rows llama.cpp interleaved in tensor `name` (None: not permuted)."""
    kind = name.split(".")[-2]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    return heads[kind] if arch.permute_qk and name.startswith("blk.") and kind in heads else None


def _native_bits(tensor, hf_name: str) -> int | None:
    """The bits a tensor keeps under dtype="native" (None: stored as float32): a quantized matrix's."""
    if len(tensor.shape) < 2 or not hf_name.endswith(".weight") or int(tensor.shape[0]) % GROUP_SIZE:
        return None
    return native_bits(tensor.tensor_type)


def _native_quantization(gguf_file: GGUFFile, names: dict) -> dict:
    """config.json's "quantization" for a native copy: every quantized layer's own bits (mlx-lm's per-layer form)."""
    layers = {names[t.name].removesuffix(".weight"): (bits, "mxfp4" if t.tensor_type == MXFP4 else "affine")
              for t in gguf_file.tensors if (bits := _native_bits(t, names[t.name])) is not None}
    bits_of = [bits for bits, mode in layers.values() if mode == "affine"]
    common = max(set(bits_of), key=bits_of.count) if bits_of else 4
    return {"group_size": GROUP_SIZE, "bits": common,
            **{layer: {"group_size": GROUP_SIZE, "bits": bits, **({"mode": mode} if mode != "affine" else {})}
               for layer, (bits, mode) in layers.items()}}


def _encode(weight: np.ndarray, dtype: str) -> memoryview:
    if dtype == "float32":
        return weight.data.cast("B")
    # MLX rounds, so a 16-bit copy holds exactly what set_dtype() makes of the float32 one.
    bits = mx.array(weight).astype(getattr(mx, dtype)).view(mx.uint16)
    return np.array(bits).astype("<u2").data.cast("B")
