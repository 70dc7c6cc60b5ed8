"""Build a Model from a Hugging Face-format directory, in the requested dtype."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from tinymlx.loader import ModelLoadError, load_config, load_weights
from tinymlx.models.qwen2 import Model, ModelArgs, use_input_major_linears

if TYPE_CHECKING:
    from tinymlx.parallel.collectives import Collectives

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
_FLOAT_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_QUANT_BITS = {"q8": 8, "q4": 4}
_QUANT_GROUP_SIZE = 64


def resolve_dtype(dtype: str) -> str:
    """'auto' picks what is fastest on the device: float32 on the CPU (BLAS), bfloat16 on a GPU."""
    if dtype != "auto":
        return dtype
    return "float32" if mx.default_device() == mx.cpu else "bfloat16"


def read_model_args(model_dir: Path) -> tuple[ModelArgs, dict]:
    """The architecture in config.json (and the config itself), or a ModelLoadError saying what is wrong."""
    config = load_config(model_dir)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{model_dir}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        return ModelArgs.from_config(config), config
    except KeyError as missing:
        raise ModelLoadError(f"{model_dir}/config.json lacks {missing}") from None


def check_tensor_parallel(model_dir: Path, dtype: str, size: int) -> None:
    """Fail before any rank starts when the model does not split evenly over `size` ranks."""
    from tinymlx.parallel.sharded_linear import check_shardable

    args, config = read_model_args(model_dir)
    check_shardable(args, size, _quant_group_size(config, resolve_dtype(dtype)))


def _quant_group_size(config: dict, dtype: str) -> int | None:
    if config.get("quantization"):
        return config["quantization"]["group_size"]
    return _QUANT_GROUP_SIZE if dtype in _QUANT_BITS else None


def load_model(model_dir: Path, dtype: str = "auto", shard: Collectives | None = None) -> Model:
    """Build the model; with `shard`, only this rank's tensor-parallel slice of it."""
    args, config = read_model_args(model_dir)
    dtype = resolve_dtype(dtype)
    model = Model(args)
    weights = load_weights(model_dir)
    if args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    weights = Model.sanitize(weights)

    quantization = config.get("quantization")
    if quantization:  # an MLX-quantized checkpoint: swap in quantized layers where scales exist
        quantized = {name.removesuffix(".scales") for name in weights if name.endswith(".scales")}
        nn.quantize(
            model, group_size=quantization["group_size"], bits=quantization["bits"],
            class_predicate=lambda path, _: path in quantized,
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        raise ModelLoadError(f"{model_dir}: weights do not match the {args.model_type} architecture: {error}") from None
    del weights  # the model holds them now; conversions below can then free what they replace

    if shard is not None:  # slice before any conversion, so every layout and dtype composes with it
        from tinymlx.parallel.sharded_linear import check_shardable

        check_shardable(args, shard.size, _quant_group_size(config, dtype))
        model.shard(shard.group, shard.all_reduce, shard.gather_vocab)
    if dtype in _FLOAT_DTYPES:
        model.set_dtype(_FLOAT_DTYPES[dtype])
    elif not quantization:
        model.set_dtype(mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16)
        nn.quantize(model, group_size=_QUANT_GROUP_SIZE, bits=_QUANT_BITS[dtype])
    if dtype == "float32" and mx.default_device() == mx.cpu:
        use_input_major_linears(model)
    mx.eval(model.parameters())
    return model


def activation_dtype(model: Model) -> mx.Dtype:
    """The dtype K/V and activations take: that of the embedding's output."""
    embed = model.model.embed_tokens
    return embed.scales.dtype if hasattr(embed, "scales") else embed.weight.dtype
