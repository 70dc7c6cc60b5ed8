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
import math
import shutil
import struct
import tempfile
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

from tinymlx.dtypes import resolve_dtype
from tinymlx.errors import ModelLoadError
from tinymlx.loader.gguf_quant import GROUP_SIZE, native_bits, native_shapes, scales_dtype, to_native
from tinymlx.loader.gguf_scan import num_weights
from tinymlx.loader.offline import cache_dir
from tinymlx.loader.progress import LoadProgress, ProgressCallback, byte_counter, ignore, progress_bar
from tinymlx.models.gguf_arch import GGUFArch, Metadata
from tinymlx.models.registry import GGUF_ARCHITECTURES, gguf_arch_for
from tinymlx.tokenizer import gguf_tokenizer_files

ARCHITECTURES = tuple(GGUF_ARCHITECTURES)  # general.architecture values that convert
_VERSION = 1  # bump when the output changes, so older conversions are rebuilt
# Stored dtype -> (safetensors dtype, bytes per weight, directory-name suffix). float32 keeps the
# dequantized values exactly; a 16-bit copy is what a model loaded in 16 bits computes with anyway.
STORED_DTYPES = {"float32": ("F32", 4, ""), "bfloat16": ("BF16", 2, "-bf16"), "float16": ("F16", 2, "-f16")}
NATIVE_SUFFIX = "-native"  # the file's own quantization (no float copy of its quantized tensors)
SUFFIXES = {**{dtype: suffix for dtype, (_, _, suffix) in STORED_DTYPES.items()}, "native": NATIVE_SUFFIX}


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
    on_progress(LoadProgress("convert", 0, 0))  # reading the GGUF and its tokenizer come before any bytes out
    reader = _open(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    arch = gguf_arch_for(meta.get("general.architecture"), f"{path}: ")
    names = {t.name: _hf_name(arch, t.name, path) for t in reader.tensors}
    config = {**_config(arch, meta, reader, path), "torch_dtype": "float32" if dtype == "native" else dtype}
    if dtype == "native":
        config["quantization"] = _native_quantization(reader, names)
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
        write = _write_native_weights if dtype == "native" else _write_weights
        write(reader, arch, names, config, tmp / "model.safetensors", progress, on_progress, dtype)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():  # not merely a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _identity(path: Path) -> str:
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _open(path: Path) -> gguf.GGUFReader:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader fails in many ways on damaged files; all mean the same
        raise ModelLoadError(
            f"{path} is a corrupt or truncated GGUF file ({path.stat().st_size:,} bytes; {error}). "
            "Delete it and download it again."
        ) from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ModelLoadError(f"{path} is truncated: {path.stat().st_size:,} bytes, tensors need {end:,}")
    return reader


def _hf_name(arch: GGUFArch, name: str, path: Path) -> str:
    hf_name = arch.hf_name(name)
    if hf_name is None:
        raise ModelLoadError(f"{path}: tensor {name!r} has no Hugging Face equivalent in {arch.name} checkpoints")
    return hf_name


def _config(arch: GGUFArch, meta: dict, reader: gguf.GGUFReader, path: Path) -> dict:
    shapes = {t.name: _shape(t) for t in reader.tensors}
    try:
        family = arch.config(Metadata(arch.name, meta, shapes))
    except KeyError as missing:
        what = "tensor" if str(missing.args[0]).endswith(".weight") else "metadata"
        raise ModelLoadError(f"{path}: GGUF {what} lacks {missing.args[0]}, which {arch.name} needs") from None
    return {"architectures": [arch.hf_architecture], "model_type": arch.model_type, **family}


def _shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's Q/K rows for its pairwise RoPE; HF rotates halves. Undo it.
    pairs = weight.reshape(num_heads, weight.shape[0] // num_heads // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def _write_weights(reader: gguf.GGUFReader, arch: GGUFArch, names: dict, config: dict, out: Path, progress: bool,
                   on_progress: ProgressCallback = ignore, dtype: str = "float32") -> None:
    """Stream tensors into a safetensors file, so peak memory is one tensor, not the model."""
    st_dtype = STORED_DTYPES[dtype][0]
    layout = {t.name: [(names[t.name], st_dtype, _shape(t))] for t in reader.tensors}
    _stream(reader, layout, out, progress, on_progress,
            lambda tensor: [_encode(np.ascontiguousarray(_float_weight(arch, config, tensor), dtype="<f4"), dtype)])


def _write_native_weights(reader: gguf.GGUFReader, arch: GGUFArch, names: dict, config: dict, out: Path,
                          progress: bool, on_progress: ProgressCallback = ignore, dtype: str = "native") -> None:
    """Quantized tensors as MLX's <name>.weight (uint32), .scales and .biases (float16 or float32, see
    gguf_quant.py); the rest float32."""
    layout = {}
    for tensor in reader.tensors:
        bits, name = _native_bits(tensor, names[tensor.name]), names[tensor.name]
        if bits is None:
            layout[tensor.name] = [(name, "F32", _shape(tensor))]
        else:
            base = name.removesuffix(".weight")
            weight_shape, scale_shape = native_shapes(_shape(tensor), bits)
            scales = "F16" if scales_dtype(tensor.tensor_type) == np.float16 else "F32"
            layout[tensor.name] = [(name, "U32", weight_shape), (f"{base}.scales", scales, scale_shape),
                                   (f"{base}.biases", scales, scale_shape)]

    def encode(tensor) -> list:
        if len(layout[tensor.name]) == 1:
            return [np.ascontiguousarray(_float_weight(arch, config, tensor), dtype="<f4").data.cast("B")]
        native = to_native(tensor.data, tensor.tensor_type, _shape(tensor))
        heads = _permuted_heads(arch, config, tensor.name)  # whole rows: of packed codes, scales and biases alike
        return [np.ascontiguousarray(part if heads is None else _unpermute(part, heads)).data.cast("B")
                for part in native[:3]]

    _stream(reader, layout, out, progress, on_progress, encode)


_ITEM_SIZE = {"F32": 4, "BF16": 2, "F16": 2, "U32": 4}


def _stream(reader: gguf.GGUFReader, layout: dict, out: Path, progress: bool, on_progress: ProgressCallback,
            encode) -> None:
    """Write each GGUF tensor's entries, (name, safetensors dtype, shape) in `layout`, from `encode(tensor)`:
    one buffer per entry."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for entries in layout.values():
        for name, st_dtype, shape in entries:
            nbytes = _ITEM_SIZE[st_dtype] * math.prod(shape)
            header[name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    written = byte_counter("convert", offset, on_progress)  # bytes out, the measure of the work
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for tensor in progress_bar(reader.tensors, desc=f"convert {Path(reader.data.filename).name}", disable=not progress):
            for buffer in encode(tensor):
                f.write(buffer)
                written(buffer.nbytes)


def _float_weight(arch: GGUFArch, config: dict, tensor) -> np.ndarray:
    """A tensor's exact float32 dequantization, with the storage tricks the family names undone."""
    weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(_shape(tensor))
    heads = _permuted_heads(arch, config, tensor.name)
    if heads is not None:
        weight = _unpermute(weight, heads)
    if arch.norm_shift and arch.is_norm(tensor.name):
        weight = weight.astype(np.float32) - np.float32(arch.norm_shift)
    return weight


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


def _native_quantization(reader: gguf.GGUFReader, names: dict) -> dict:
    """config.json's "quantization" for a native copy: every quantized layer's own bits (mlx-lm's per-layer form)."""
    layers = {names[t.name].removesuffix(".weight"): bits for t in reader.tensors
              if (bits := _native_bits(t, names[t.name])) is not None}
    common = max(set(layers.values()), key=list(layers.values()).count) if layers else 4
    return {"group_size": GROUP_SIZE, "bits": common,
            **{layer: {"group_size": GROUP_SIZE, "bits": bits} for layer, bits in layers.items()}}


def _encode(weight: np.ndarray, dtype: str) -> memoryview:
    if dtype == "float32":
        return weight.data.cast("B")
    # MLX rounds, so a 16-bit copy holds exactly what set_dtype() makes of the float32 one.
    bits = mx.array(weight).astype(getattr(mx, dtype)).view(mx.uint16)
    return np.array(bits).astype("<u2").data.cast("B")
