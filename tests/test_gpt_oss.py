"""gpt-oss against transformers, in float32: attention sinks, alternating sliding-window (8 here) and full
layers, biases everywhere, YaRN RoPE, and the clamped-SwiGLU mixture of experts, at prefill and at every
teacher-forced decode step through the paged cache (prompts several windows long), on both kernel paths;
then the engine: batched == sequential, prefix hits == uncached, preemption in a small pool."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import (
    ByteTokenizer,
    dense_logits,
    hf_logits,
    max_diff,
    paged_logits,
    random_workload,
    run_to_completion,
)

from tinymlx import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.models import FullAttention, SlidingWindow, load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=512, rms_norm_eps=1e-5)
ATOL = 1e-4


def hf_checkpoint(path: Path, seed: int = 0, std: float = 0.2, **overrides):
    config = transformers.GptOssConfig(**{**CONFIG, **overrides})
    config._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # beyond HF's init, so every term matters
            param.normal_(0, 1.0 if name.endswith("sinks") else std)
            if "norm" in name:
                param.add_(1.0)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "m"
    return hf_checkpoint(path), path


def test_logits_equal_transformers_at_prefill_and_every_decode_step(checkpoint, kernel_path):
    hf_model, path = checkpoint
    model = load_model(path, dtype="float32")
    assert model.layer_specs() == (SlidingWindow(8), FullAttention()) * 2
    tokens = np.random.default_rng(1).integers(0, 300, 60).tolist()
    reference = hf_logits(hf_model, tokens)
    assert max_diff(dense_logits(model, tokens), reference) < ATOL
    for block_size, chunk_size in ((4, 8), (16, None)):  # prompts of 36 tokens: four and a half windows
        paged = paged_logits(model, tokens, prompt_len=36, block_size=block_size, chunk_size=chunk_size, query_tile=8)
        assert len(paged) == len(tokens) - 36 + 1
        for step, logits in enumerate(paged):
            assert max_diff(logits, reference[35 + step]) < ATOL, (block_size, step)
    for layer in model.model.layers:  # the sinks matter: without them the logits are another model's
        layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, -mx.inf)
    assert max_diff(dense_logits(model, tokens), reference) > 1e-2


def sequential_outputs(model, arrivals: dict[int, list[tuple]]) -> dict[str, list[int]]:
    outputs = {}
    for request in (item for step in sorted(arrivals) for item in arrivals[step]):
        engine = Engine(model, ByteTokenizer(), EngineConfig(block_size=4, num_pages=256, enable_prefix_caching=False))
        outputs.update(run_to_completion(engine, {0: [request]}))
    return outputs


def test_batched_prefix_hits_and_preemption_change_no_tokens(checkpoint):
    _, path = checkpoint
    model = load_model(path, dtype="float32")
    arrivals = random_workload(10, seed=4, max_arrival=2, seeded_sampling=True)
    shared = np.random.default_rng(2).integers(0, 256, 20).tolist()  # a prefix deeper than the window
    with_prefix = {step: [(shared + p, params, r) for p, params, r in items] for step, items in arrivals.items()}
    for workload, num_pages in ((with_prefix, 256), (arrivals, 36)):  # roomy with hits; small enough to preempt
        engine = Engine(model, ByteTokenizer(), EngineConfig(block_size=4, num_pages=num_pages,
                                                             max_num_batched_tokens=32))
        expected = sequential_outputs(model, workload)
        assert run_to_completion(engine, {k: list(v) for k, v in workload.items()}) == expected
        stats = engine.stats()
        assert stats.prefix_hit_rate > 0.1 if workload is with_prefix else stats.num_preemptions > 0


def test_two_ranks_give_one_ranks_tokens_and_logprobs(checkpoint):
    """Heads with their sinks and every expert's FFN split over the ranks (the down projection's bias
    shared out, so the all-reduce sums it back to one)."""
    from test_tensor_parallel import TP, load_engine

    _, path = checkpoint
    arrivals = random_workload(8, seed=6, max_arrival=2, seeded_sampling=True)
    for items in arrivals.values():
        items[:] = [(p, dataclasses.replace(params, logprobs=2), r) for p, params, r in items]
    single = load_engine(path, dtype="float32")
    expected = {r: o for r, o in run_outputs_of(single, arrivals).items()}
    sharded = load_engine(path, TP, dtype="float32")
    try:
        attn = sharded.runner.model.model.layers[0].self_attn
        assert attn.sinks.shape == (CONFIG["num_attention_heads"] // TP,)
        outputs = run_outputs_of(sharded, arrivals)
    finally:
        sharded.close()
    assert {r: o.token_ids for r, o in outputs.items()} == {r: o.token_ids for r, o in expected.items()}
    for r, output in outputs.items():
        ours = np.array([[t.logprob, *(lp for _, lp in t.top)] for t in output.logprobs])
        theirs = np.array([[t.logprob, *(lp for _, lp in t.top)] for t in expected[r].logprobs])
        assert np.abs(ours - theirs).max() < 1e-4


def run_outputs_of(engine, arrivals):
    from tiny_models import run_outputs

    return run_outputs(engine, {k: list(v) for k, v in arrivals.items()})


@pytest.mark.parametrize(("dtype", "tolerance"), [("q8", 0.05), ("q4", 0.5)])
def test_quantized_load_and_run(tmp_path, dtype, tolerance):
    """The experts' gather_qmm with their biases, the attention linears quantized: the mean error is bounded,
    relative to the logits' size (a dropped bias or a wrong expert gives 100% and more)."""
    path = tmp_path / "m"
    hf_checkpoint(path, std=0.05, intermediate_size=64)  # whole groups of 64 in every input width
    tokens = np.random.default_rng(0).integers(0, 300, 40).tolist()
    reference = np.array(dense_logits(load_model(path, dtype="float32"), tokens))
    quantized = load_model(path, dtype=dtype)
    assert "scales" in quantized.model.layers[0].mlp.switch_mlp.gate_proj
    error = np.abs(np.array(dense_logits(quantized, tokens)) - reference).mean()
    assert error < tolerance * np.abs(reference).mean(), error / np.abs(reference).mean()


def mxfp4_checkpoint(float_dir: Path, path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """`float_dir`'s checkpoint with its experts as published: random MXFP4 blocks and e8m0 scales (the
    float expert weights dropped), and the quantization_config that says so. Returns the tensors written."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(float_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    E, D, inter = CONFIG["num_local_experts"], CONFIG["hidden_size"], CONFIG["intermediate_size"]
    for layer in range(CONFIG["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        for name, (out_features, in_features) in (("gate_up_proj", (2 * inter, D)), ("down_proj", (D, inter))):
            del tensors[prefix + name]
            tensors[prefix + name + "_blocks"] = torch.randint(0, 256, (E, out_features, in_features // 32, 16),
                                                              dtype=torch.uint8, generator=generator)
            tensors[prefix + name + "_scales"] = torch.randint(122, 128, (E, out_features, in_features // 32),
                                                              dtype=torch.uint8, generator=generator)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def test_mxfp4_experts_load_as_mlx_mxfp4_bit_for_bit(checkpoint, tmp_path):
    """The published MXFP4 experts become MLX's mxfp4 quantized experts as stored, whose values are bit for
    bit transformers' dequantization; the model then gives the logits of the float model of those values
    (transformers' own, run on the dequantized weights)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, float_dir = checkpoint
    tensors = mxfp4_checkpoint(float_dir, tmp_path / "mxfp4")
    model = load_model(tmp_path / "mxfp4")  # "auto": as stored
    experts = model.model.layers[1].mlp.switch_mlp
    assert experts.gate_proj.mode == "mxfp4" and experts.gate_proj.weight.dtype == mx.uint32
    prefix = "model.layers.1.mlp.experts."
    gate_up = convert_moe_packed_tensors(tensors[prefix + "gate_up_proj_blocks"], tensors[prefix + "gate_up_proj_scales"],
                                         dtype=torch.float32).numpy()  # [E, D, 2I]: interleaved gate, up
    down = convert_moe_packed_tensors(tensors[prefix + "down_proj_blocks"], tensors[prefix + "down_proj_scales"],
                                      dtype=torch.float32).numpy()  # [E, I, D]

    def values(linear) -> np.ndarray:  # [E, in, out]
        return np.array(mx.dequantize(linear.weight, linear.scales, None, group_size=32, bits=4,
                                      mode="mxfp4").astype(mx.float32)).swapaxes(-1, -2)

    assert np.array_equal(values(experts.gate_proj), gate_up[..., ::2])
    assert np.array_equal(values(experts.up_proj), gate_up[..., 1::2])
    assert np.array_equal(values(experts.down_proj), down)

    dequantized = dict(tensors)  # the float checkpoint of the same values, for transformers
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            dequantized[p + name] = convert_moe_packed_tensors(dequantized.pop(p + name + "_blocks"),
                                                               dequantized.pop(p + name + "_scales"), dtype=torch.float32)
    hf_model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG))
    hf_model.config._attn_implementation = "eager"
    hf_model.load_state_dict(dequantized, strict=True)
    hf_model.eval()
    tokens = np.random.default_rng(3).integers(0, 300, 24).tolist()
    assert max_diff(dense_logits(model, tokens), hf_logits(hf_model, tokens)) < 1e-3


@pytest.mark.parametrize("quantization", [{"group_size": 32, "bits": 4, "mode": "mxfp4"},
                                          {"group_size": 64, "bits": 8, "mode": "affine"}])
def test_mlx_lm_converted_checkpoints_load_by_their_names(checkpoint, tmp_path, quantization):
    """mlx-lm's layout: the experts split already (`mlp.experts.gate_proj.weight` packed, `.scales`, `.bias`),
    `mlp.router`, a top-level "quantization". Where it does not describe the experts (affine 8-bit defaults
    beside MXFP4 experts, no per-layer entry), their stored tensors do. The logits equal the published
    layout's."""
    import json

    from safetensors.numpy import save_file

    _, float_dir = checkpoint
    mxfp4_checkpoint(float_dir, tmp_path / "hf")
    published = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    converted = {}
    for name, value in published.items():
        prefix, _, part = name.partition(".mlp.experts.")
        if part in ("gate_up_proj_blocks", "gate_up_proj_scales"):
            value = value.reshape(*value.shape[:-2], -1).view(mx.uint32) if part.endswith("blocks") else value
            suffix = "weight" if part.endswith("blocks") else "scales"
            converted[f"{prefix}.mlp.experts.gate_proj.{suffix}"] = value[:, ::2]
            converted[f"{prefix}.mlp.experts.up_proj.{suffix}"] = value[:, 1::2]
        elif part == "gate_up_proj_bias":
            converted[f"{prefix}.mlp.experts.gate_proj.bias"] = value[..., ::2]
            converted[f"{prefix}.mlp.experts.up_proj.bias"] = value[..., 1::2]
        elif part in ("down_proj_blocks", "down_proj_scales", "down_proj_bias"):
            key = {"down_proj_blocks": "weight", "down_proj_scales": "scales", "down_proj_bias": "bias"}[part]
            converted[f"{prefix}.mlp.experts.down_proj.{key}"] = (
                value.reshape(*value.shape[:-2], -1).view(mx.uint32) if key == "weight" else value)
        else:
            converted[name] = value
    (tmp_path / "mlx").mkdir()
    save_file({k: np.array(mx.contiguous(v)) for k, v in converted.items()}, str(tmp_path / "mlx" / "model.safetensors"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "mlx" / "config.json").write_text(json.dumps({**config, "quantization": quantization}))
    tokens = np.random.default_rng(5).integers(0, 300, 20).tolist()
    ours = load_model(tmp_path / "mlx")
    assert ours.model.layers[0].mlp.switch_mlp.down_proj.mode == "mxfp4"
    assert max_diff(dense_logits(ours, tokens), dense_logits(load_model(tmp_path / "hf"), tokens)) < 1e-5
