"""Build a model from a Hugging Face-format directory, in the requested dtype, through the family registry.

A quantized checkpoint (config.json's "quantization": an MLX-quantized one, or a GGUF's native copy, whose
layers each keep their own bits) loads as stored under "native" and "auto"; see tinymlx/core/dtypes.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from tinymlx.core import refusals
from tinymlx.core.config import EngineConfig
from tinymlx.core.dtypes import FLOAT_DTYPES, QUANT_BITS, QUANT_GROUP_SIZE, native_float_dtype, resolve_dtype
from tinymlx.core.errors import ModelLoadError
from tinymlx.core.layer_specs import (
    FullAttention,
    LayerSpec,
    Recurrent,
    SharedKV,
    SlidingWindow,
    kv_groups,
    recurrent_layers,
)
from tinymlx.core.pipeline_stage import PipelineStage
from tinymlx.models.base import AttentionBackend, BaseModelArgs, CausalLM, ImageRows, TensorParallelGroup
from tinymlx.models.checkpoint import load_config, load_weights
from tinymlx.models.mtp import HeadInput, MTPModel
from tinymlx.models.registry import SUPPORTED_MODEL_TYPES, family_for, model_type_of
from tinymlx.ops import kernels

__all__ = [
    "SUPPORTED_MODEL_TYPES", "AttentionBackend", "BaseModelArgs", "CausalLM", "FullAttention", "LayerSpec",
    "Recurrent", "SlidingWindow", "activation_dtype", "args_from_config", "build_model", "check_tensor_parallel",
    "HeadInput", "ImageRows", "MTPModel", "kv_groups", "load_model", "load_mtp_head", "read_model_args", "recurrent_layers",
    "resolve_dtype", "StageCosts", "stage_costs",
]


def args_from_config(config: dict, where: str = "config.json") -> BaseModelArgs:
    """The family's arguments for a config.json dict, or a ModelLoadError naming what is wrong."""
    model_type = model_type_of(config)
    family = family_for(model_type, f"{where}: ")
    try:
        return family.args.from_config({**config, "model_type": model_type})
    except KeyError as missing:
        raise ModelLoadError(f"{where} lacks {missing}, which {config['model_type']} needs") from None
    except ValueError as error:
        raise ModelLoadError(f"{where}: {error}") from None


def read_model_args(model_dir: Path) -> tuple[BaseModelArgs, dict]:
    """The architecture in config.json (and the config itself)."""
    config = load_config(model_dir)
    return args_from_config(config, f"{model_dir}/config.json"), config


def build_model(args: BaseModelArgs) -> CausalLM:
    """A model of `args`' family with fresh weights; ValueError when its layers cannot be built. Loading a
    model is when the process's kernels are chosen (the CPU's or the portable ones: ops/kernels.py)."""
    kernels.choose()
    model = family_for(args.model_type).model(args)
    model.layer_specs()  # an unknown kind of layer fails here, before any weight is read
    return model


def check_tensor_parallel(model_dir: Path, dtype: str, size: int) -> None:
    """Fail before any rank starts when the model does not split evenly over `size` ranks, or has layers no
    rank can split (core/refusals.py), from its config alone."""
    args, config = read_model_args(model_dir)
    model = family_for(args.model_type).model
    refusals.check(EngineConfig(tensor_parallel_size=size), model.layer_specs_of(args), model_type=args.model_type)
    model.check_shardable(args, size, _quant_group_size(config, dtype))


class StageCosts(NamedTuple):
    """What each part of a model costs a pipeline stage, in bytes (parallel/stage_split.py balances them)."""

    layers: tuple[int, ...]  # each decoder layer's weights as stored, and the state its kind keeps
    first: int  # the embedding, before the first layer
    last: int  # the final norm and the head after the last layer (a tied head: the embedding again)
    cuts: tuple[int, ...]  # the layers a stage may start at: none between a KV-shared layer and its source


def stage_costs(model_dir: Path, context_tokens: int) -> StageCosts:
    """Each part's bytes, read from the checkpoint's tensor headers (mx.load is lazy: no weight is read), a
    layer's state counted at 16 bits for `context_tokens` tokens (its window's, for a sliding layer), or its
    recurrent state's float32 for one sequence."""
    args, _ = read_model_args(model_dir)
    model = family_for(args.model_type).model
    layers = [0] * args.num_hidden_layers
    first = last = 0
    for name, tensor in model(args).sanitize(load_weights(model_dir)).items():
        layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if layer is not None and int(layer.group(1)) < len(layers):
            layers[int(layer.group(1))] += tensor.nbytes
        elif "embed_tokens" in name:
            first += tensor.nbytes
            last += tensor.nbytes if args.tie_word_embeddings else 0
        else:
            last += tensor.nbytes
    specs = model.layer_specs_of(args)
    for layer, spec in enumerate(specs):
        if isinstance(spec, Recurrent):
            layers[layer] += 4 * spec.num_state_floats
        elif isinstance(spec, FullAttention | SlidingWindow):
            tokens = min(context_tokens, spec.window) if isinstance(spec, SlidingWindow) else context_tokens
            heads, dim = spec.kv_heads or args.num_key_value_heads, spec.head_dim or args.head_dim
            layers[layer] += 2 * 2 * heads * dim * tokens
    cuts = tuple(cut for cut in range(1, len(layers)) if not any(
        isinstance(spec, SharedKV) and layer >= cut > spec.source for layer, spec in enumerate(specs)))
    return StageCosts(tuple(layers), first, last, cuts)


def _quant_group_size(config: dict, dtype: str) -> int | None:
    quantization = _checkpoint_quantization(config)
    if quantization:
        return quantization["group_size"]
    return QUANT_GROUP_SIZE if dtype in QUANT_BITS else None


def _checkpoint_quantization(config: dict) -> dict | None:
    """How the checkpoint's quantized layers are stored: MLX's "quantization" (mlx-lm's, a GGUF's native
    copy), or a Hugging Face quantization_config MLX has layers for (gpt-oss's MXFP4 experts)."""
    if config.get("quantization"):
        return config["quantization"]
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return None


def load_model(model_dir: Path, dtype: str = "auto", shard: TensorParallelGroup | None = None,
               stage: PipelineStage | None = None) -> CausalLM:
    """Build the model; with `shard`, only this rank's tensor-parallel slice of it; with `stage`, only that
    pipeline stage's part, reading only its tensors. Every check runs before the model's weights are set: a
    failure leaves nothing half-loaded."""
    args, config = read_model_args(model_dir)
    try:
        model = build_model(args)
    except ValueError as error:
        raise ModelLoadError(f"{model_dir}/config.json: {error}") from None
    quantization = _checkpoint_quantization(config)
    if dtype == "auto":  # a quantized checkpoint as stored; a float one by the size of its float32 weights
        dtype = "native" if quantization else resolve_dtype(dtype, 4 * _num_parameters(model))
    if stage is not None:  # after the dtype, which every stage chooses for the whole model alike
        refusals.check(EngineConfig(pipeline_parallel_size=stage.num_stages), model.layer_specs(),
                       model_type=args.model_type, splits_into_stages=not model.sees_images)
        model.keep_stage(stage)
    if shard is not None:
        refusals.check(EngineConfig(tensor_parallel_size=shard.size), model.layer_specs(), model_type=args.model_type)
        model.check_shardable(args, shard.size, _quant_group_size(config, dtype))
    try:
        weights = model.stage_weights(model.sanitize(load_weights(model_dir)))
    except ModelLoadError as error:
        raise ModelLoadError(f"{model_dir}: {error}") from None

    if quantization:
        _quantize_as_stored(model, quantization, weights)
    _check_weights(model, weights, f"{model_dir}: weights do not match the {args.model_type} architecture")
    model.load_weights(list(weights.items()), strict=True)
    del weights  # the model holds them now; conversions below can then free what they replace

    if shard is not None:  # slice before any conversion, so every layout and dtype composes with it
        model.shard(shard.group, shard.all_reduce, shard.gather_vocab)
    if dtype == "native":
        _set_native_dtype(model)
    elif dtype in FLOAT_DTYPES:
        model.set_dtype(FLOAT_DTYPES[dtype])  # scales too; the packed codes are ints
    elif not quantization:
        model.set_dtype(native_float_dtype())
        nn.quantize(model, group_size=QUANT_GROUP_SIZE, bits=QUANT_BITS[dtype])
    if dtype in ("float32", "native"):
        kernels.chosen().prepare_float_model(model)  # the float linears a native model keeps, too
    mx.eval(model.parameters())
    return model


def load_mtp_head(model_dir: Path, target: CausalLM) -> MTPModel:
    """The multi-token-prediction head of the checkpoint `target` was loaded from (models/mtp.py), in the
    target's activation dtype (quantized where an MLX-quantized checkpoint quantized it). A ModelLoadError
    when the family has none or the checkpoint does not ship one."""
    what = f"{model_dir}: speculative='mtp' drafts with the checkpoint's multi-token-prediction head"
    if not hasattr(target, "mtp_head"):
        raise ModelLoadError(f"{what}, and {target.args.model_type} models have none (Qwen3.5, Qwen3.6 and "
                             "Qwen3-Next do)")
    body, weights = target.mtp_head(load_weights(model_dir))
    if body is None:
        raise ModelLoadError(f"{what}, but it has no mtp.* weights (conversions often drop them): use the "
                             "original checkpoint, or speculative='ngram'")
    quantization = _checkpoint_quantization(load_config(model_dir))
    if quantization:
        _quantize_as_stored(body, quantization, weights)
    _check_weights(body, weights, f"{model_dir}: the mtp.* weights do not match {target.args.model_type}'s head")
    body.load_weights(list(weights.items()), strict=True)
    if not quantization:
        body.set_dtype(activation_dtype(target))
    mx.eval(body.parameters())
    return MTPModel(target, body)


def _set_native_dtype(model: CausalLM) -> None:
    """Float tensors in the device's dtype (native_float_dtype). On the CPU a quantized matmul's 16-bit
    scales and biases stay as stored: MLX computes with them in float32 at the same speed (measured), so
    a GGUF's float16 ones stay exact in half the bytes. An embedding's are widened: its lookup returns
    their dtype, which every activation then takes."""
    dtype = native_float_dtype()
    kept = [] if dtype != mx.float32 else [
        (module, {name: module[name] for name in ("scales", "biases") if name in module})
        for module in model.modules() if "scales" in module and not isinstance(module, nn.QuantizedEmbedding)]
    model.set_dtype(dtype)
    for module, arrays in kept:  # the casts set_dtype built for these are never evaluated
        module.update(arrays)


def _quantize_as_stored(module: nn.Module, quantization: dict, weights: dict[str, mx.array]) -> None:
    """A quantized checkpoint: swap in quantized layers where it stored scales, each as its own entry (mlx-lm's
    per-layer form, a GGUF's mixed types) or its tensors say, over the defaults."""
    quantized = {name.removesuffix(".scales") for name in weights if name.endswith(".scales")}
    nn.quantize(module, group_size=quantization["group_size"], bits=quantization["bits"],
                mode=quantization.get("mode", "affine"),
                class_predicate=lambda path, layer: path in quantized and _layer_quantization(
                    quantization, path, weights, layer))


def _layer_quantization(quantization: dict, path: str, weights: dict[str, mx.array],
                        module: nn.Module) -> dict | bool:
    """A layer's own entry; else, where its stored scales disagree with the defaults (a family whose sanitize
    renamed the layer: gpt-oss's mlx-lm experts, MXFP4 beside affine 8-bit), what the tensors themselves say:
    uint8 scales are MXFP4's e8m0, float ones affine."""
    layer = quantization.get(path)
    if isinstance(layer, dict):
        return {"group_size": layer["group_size"], "bits": layer["bits"], "mode": layer.get("mode", "affine")}
    scales, in_dims = weights[f"{path}.scales"], module.weight.shape[-1]
    stored = {"group_size": in_dims // scales.shape[-1], "bits": weights[f"{path}.weight"].shape[-1] * 32 // in_dims,
              "mode": "mxfp4" if scales.dtype == mx.uint8 else "affine"}
    defaults = {"group_size": quantization["group_size"], "bits": quantization["bits"],
                "mode": quantization.get("mode", "affine")}
    return True if stored == defaults else stored


def _num_parameters(model: CausalLM) -> int:
    return sum(param.size for _, param in tree_flatten(model.parameters()))


def _check_weights(model: CausalLM, weights: dict[str, mx.array], what: str) -> None:
    """Name the first tensor that does not fit: missing, of another shape, or not part of the model."""
    expected = tree_flatten(model.parameters())
    for name, param in expected:
        if name not in weights:
            raise ModelLoadError(f"{what}: {name} is missing")
        if weights[name].shape != param.shape:
            raise ModelLoadError(f"{what}: {name} has shape {tuple(weights[name].shape)}, "
                                 f"the architecture needs {tuple(param.shape)}")
    names = {name for name, _ in expected}
    unexpected = [name for name in weights if name not in names]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ModelLoadError(f"{what}: {unexpected[0]} is not part of it{more}")


def activation_dtype(model: CausalLM) -> mx.Dtype:
    """The dtype K/V and activations take: that of the embedding's output; on a pipeline stage without the
    embedding, its layers' norms' (every load sets the norms in the embedding's dtype)."""
    if "embed_tokens" not in model.model:
        layer = next(layer for layer in model.model.layers if layer is not None)
        return next(p.dtype for name, p in tree_flatten(layer.parameters()) if name.endswith("norm.weight"))
    embed = model.model.embed_tokens
    if "scales" in embed:
        return embed.scales.dtype
    return embed.weight_t.dtype if "weight_t" in embed else embed.weight.dtype
