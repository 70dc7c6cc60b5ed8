"""Convert a GGUF file (any quant type) into a Hugging Face-format directory in the cache.

The directory holds config.json, generation_config.json, a model.safetensors with HF tensor names
(float32, or the 16-bit float the model is loaded in), tokenizer.json and tokenizer_config.json, so
the rest of tinymlx reads one format. It is keyed by the file's identity and the stored dtype, and
built in a temp dir then renamed, so a second start reuses it and an interrupted conversion leaves
nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
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
from tinymlx.tokenizer import gguf_tokenizer_files

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_VERSION = 1  # bump when the output changes, so older conversions are rebuilt
# Stored dtype -> (safetensors dtype, bytes per weight, directory-name suffix). float32 keeps the
# dequantized values exactly; a 16-bit copy is what a model loaded in 16 bits computes with anyway.
STORED_DTYPES = {"float32": ("F32", 4, ""), "bfloat16": ("BF16", 2, "-bf16"), "float16": ("F16", 2, "-f16")}

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


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
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    names = {t.name: _hf_name(t.name, path) for t in reader.tensors}
    config = {**_config(meta, arch, reader, path), "torch_dtype": dtype}
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
        _write_weights(reader, names, config, tmp / "model.safetensors", progress, on_progress, dtype)
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


def _hf_name(name: str, path: Path) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER_NAME.fullmatch(name)
    if match and match[2] in _LAYER_PARTS:
        return f"model.layers.{match[1]}.{_LAYER_PARTS[match[2]]}.{match[3]}"
    raise ModelLoadError(f"{path}: tensor {name!r} has no Hugging Face equivalent in this converter")


def _f32(value: float) -> float:
    """GGUF stores floats as f32; keep the short value the model was published with (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def _config(meta: dict, arch: str, reader: gguf.GGUFReader, path: Path) -> dict:
    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor")
    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim or hidden // heads,
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": need("context_length"),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        config["rope_scaling"] = {
            "type": scaling,
            "rope_type": scaling,
            "factor": _f32(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length"),
        }
    return config


def _shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's Q/K rows for its pairwise RoPE; HF rotates halves. Undo it.
    pairs = weight.reshape(num_heads, weight.shape[0] // num_heads // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def _write_weights(reader: gguf.GGUFReader, names: dict, config: dict, out: Path, progress: bool,
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
            if config["model_type"] == "llama" and kind in heads:
                weight = _unpermute(weight, heads[kind])
            f.write(_encode(np.ascontiguousarray(weight, dtype="<f4"), dtype))
            written(width * weight.size)


def _encode(weight: np.ndarray, dtype: str) -> memoryview:
    if dtype == "float32":
        return weight.data.cast("B")
    # MLX rounds, so a 16-bit copy holds exactly what set_dtype() makes of the float32 one.
    bits = mx.array(weight).astype(getattr(mx, dtype)).view(mx.uint16)
    return np.array(bits).astype("<u2").data.cast("B")
