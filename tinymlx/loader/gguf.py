"""Convert a GGUF file (any quant type) into a Hugging Face-format directory in the cache.

The directory holds config.json, generation_config.json, a model.safetensors with HF tensor names
(float32, or the 16-bit float the model is loaded in), tokenizer.json and tokenizer_config.json, so
the rest of tinymlx reads one format. What each architecture's tensors and metadata are called is
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

def stored_dtype(dtype: str | None) -> str:
    """The dtype a GGUF's converted copy keeps for a model loaded as `dtype` (None: float32, fits any).

    It is the dtype load_model computes from, so loading loses nothing and the disk holds no bits
    the model drops: float32 on the CPU (BLAS's fast path), bfloat16 for "auto" on a GPU (half the size).
    """
    if dtype is None:
        return "float32"
    dtype = resolve_dtype(dtype)
    if dtype in STORED_DTYPES:
        return dtype
    return "float32" if mx.default_device() == mx.cpu else "bfloat16"  # q4/q8 quantize from this


def convert_gguf(
    path: str | Path, progress: bool = True, on_progress: ProgressCallback = ignore, dtype: str = "float32"
) -> Path:
    """The cached HF-format directory for a GGUF, its weights stored as `dtype` (see STORED_DTYPES)."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    if dtype not in STORED_DTYPES:
        raise ValueError(f"cannot store converted weights as {dtype!r} (choose from {', '.join(STORED_DTYPES)})")
    out = cache_dir() / "converted" / f"{path.stem}-{_identity(path)}{STORED_DTYPES[dtype][2]}"
    if (out / "config.json").is_file():  # only complete conversions are ever renamed into place
        return out
    on_progress(LoadProgress("convert", 0, 0))  # reading the GGUF and its tokenizer come before any bytes out
    reader = _open(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    arch = gguf_arch_for(meta.get("general.architecture"), f"{path}: ")
    names = {t.name: _hf_name(arch, t.name, path) for t in reader.tensors}
    config = {**_config(arch, meta, reader, path), "torch_dtype": dtype}
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
        _write_weights(reader, arch, names, config, tmp / "model.safetensors", progress, on_progress, dtype)
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
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    st_dtype, width, _ = STORED_DTYPES[dtype]
    for tensor in reader.tensors:
        shape = _shape(tensor)
        nbytes = width * math.prod(shape)
        header[names[tensor.name]] = {
            "dtype": st_dtype,
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    written = byte_counter("convert", offset, on_progress)  # bytes out, the measure of the work
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for tensor in progress_bar(reader.tensors, desc=f"convert {Path(reader.data.filename).name}", disable=not progress):
            weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(_shape(tensor))
            kind = tensor.name.split(".")[-2]
            if arch.permute_qk and tensor.name.startswith("blk.") and kind in heads:
                weight = _unpermute(weight, heads[kind])
            if arch.norm_shift and arch.is_norm(tensor.name):
                weight = weight.astype(np.float32) - np.float32(arch.norm_shift)
            f.write(_encode(np.ascontiguousarray(weight, dtype="<f4"), dtype))
            written(width * weight.size)


def _encode(weight: np.ndarray, dtype: str) -> memoryview:
    if dtype == "float32":
        return weight.data.cast("B")
    # MLX rounds, so a 16-bit copy holds exactly what set_dtype() makes of the float32 one.
    bits = mx.array(weight).astype(getattr(mx, dtype)).view(mx.uint16)
    return np.array(bits).astype("<u2").data.cast("B")
