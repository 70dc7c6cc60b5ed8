"""Every family against transformers itself: a tiny random checkpoint written by save_pretrained, the
same logits at prefill and at every teacher-forced decode step through the paged cache."""

from __future__ import annotations

import copy
import json
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

from tinymlx import SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.core.errors import ModelLoadError
from tinymlx.engine.engine import Engine
from tinymlx.models import FullAttention, SlidingWindow, args_from_config, load_model
from tinymlx.models.moe import QuantizedSwitchLinear, SwitchLinear
from tinymlx.ops import kernels
from tinymlx.ops.cpu.linear import CPUEmbedding, CPULinear

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
GEMMA = dict(sliding_window=16, query_pre_attn_scalar=24, rope_theta=1e6, rope_local_base_freq=1e4)

VARIANTS = {  # name: (transformers config class, its arguments)
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "llama3-rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False}),
    "qwen3-tied": ("Qwen3Config", {"tie_word_embeddings": True}),
    "qwen3-sliding": ("Qwen3Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3-yarn": ("Qwen3Config", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                       "original_max_position_embeddings": 32}}),
    "qwen3_moe": ("Qwen3MoeConfig", {**MOE, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3_moe-sparse-step": ("Qwen3MoeConfig", {**MOE, "norm_topk_prob": False, "decoder_sparse_step": 2}),
    "gemma3_text": ("Gemma3TextConfig", {**GEMMA, "sliding_window_pattern": 3}),
    "gemma3_text-softcap": ("Gemma3TextConfig", {**GEMMA, "num_hidden_layers": 2, "sliding_window_pattern": 2,
                                                 "final_logit_softcapping": 5.0,
                                                 "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
}


def hf_checkpoint(path: Path, variant: str, seed: int = 0, std: float = 0.2, **overrides):
    """A random transformers model of `variant`, saved (float32 safetensors) to `path`; returns the model."""
    config_class, arguments = VARIANTS[variant]
    # transformers writes into the dicts it is given (rope_scaling): hand it copies
    config = getattr(transformers, config_class)(**copy.deepcopy({**COMMON, **arguments, **overrides}))
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # beyond HF's tiny init, so every term matters
            param.normal_(0, std)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers_at_prefill_and_every_decode_step(tmp_path, variant, kernel_path):
    hf_model = hf_checkpoint(tmp_path / "m", variant)
    model = load_model(tmp_path / "m", dtype="float32")
    if kernels.chosen().name == "cpu":  # every family gets the CPU's float32 linears, a tied lm_head too
        assert type(model.model.layers[0].self_attn.q_proj) is CPULinear
        tied = model.args.tie_word_embeddings
        assert (type(model.model.embed_tokens) is CPUEmbedding) == tied
    gemma = variant.startswith("gemma")
    prompt_len, n = (70, 100) if gemma else (20, 44)  # Gemma: several 16-token windows
    tokens = np.random.default_rng(1).integers(0, 300, n).tolist()
    reference = hf_logits(hf_model, tokens)
    assert max_diff(dense_logits(model, tokens), reference) < ATOL
    for block_size, chunk_size in ((4, 7), (16, None)):
        paged = paged_logits(model, tokens, prompt_len=prompt_len, block_size=block_size, chunk_size=chunk_size,
                             query_tile=8)
        assert len(paged) == n - prompt_len + 1
        for step, logits in enumerate(paged):
            assert max_diff(logits, reference[prompt_len - 1 + step]) < ATOL, (block_size, step)


def test_gemma3_layers_declare_their_windows(tmp_path):
    hf_checkpoint(tmp_path / "m", "gemma3_text", num_hidden_layers=6)
    model = load_model(tmp_path / "m", dtype="float32")
    window = SlidingWindow(16)
    assert model.layer_specs() == (window, window, FullAttention(), window, window, FullAttention())
    assert load_model(_saved_qwen3(tmp_path), dtype="float32").layer_specs() == (FullAttention(),) * 3


def _saved_qwen3(tmp_path: Path) -> Path:
    hf_checkpoint(tmp_path / "q", "qwen3")
    return tmp_path / "q"


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_moe", "gemma3_text"])
def test_batched_equals_sequential_through_the_engine(tmp_path, variant):
    hf_checkpoint(tmp_path / "m", variant)
    model = load_model(tmp_path / "m", dtype="float32")
    arrivals = random_workload(6, seed=3, max_arrival=2)
    requests = [item for step in sorted(arrivals) for item in arrivals[step]]

    def engine() -> Engine:
        return Engine(model, ByteTokenizer(), EngineConfig(block_size=4, num_pages=256, enable_prefix_caching=False))

    batched = run_to_completion(engine(), {0: requests})
    for request in requests:
        assert run_to_completion(engine(), {0: [request]}) == {request[2]: batched[request[2]]}


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_moe", "gemma3_text"])
def test_prefix_hits_preemption_and_aborts_change_no_tokens(tmp_path, variant):
    """Requests sharing a 72-token prefix (over 4 of Gemma's 16-token windows): with prefix hits, and in a
    pool small enough to preempt, with one request aborted mid-stream, the others' tokens are those of an
    engine with neither; every step checked (run_to_completion). Gemma's pool also holds its window blocks
    (2 window layers to 1 global: a window block costs 2 of the shared pool's)."""
    hf_checkpoint(tmp_path / "m", variant)
    model = load_model(tmp_path / "m", dtype="float32")
    rng = np.random.default_rng(4)
    shared = rng.integers(0, 256, 72).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = [(shared + rng.integers(0, 256, 2 + i % 2).tolist(), params, f"r{i}") for i in range(4)]  # 19 blocks

    def engine(**config) -> Engine:
        return Engine(model, ByteTokenizer(), EngineConfig(block_size=4, max_num_batched_tokens=32, **config))

    reference = run_to_completion(engine(num_pages=256, enable_prefix_caching=False), {0: requests})
    cached = engine(num_pages=256)
    assert run_to_completion(cached, {0: requests[:1], 4: requests[1:]}) == reference
    assert cached.kv_coordinator.num_hit_tokens >= 3 * 72 - 3 * 4  # each later request resumed near the prefix end
    small_pool = 64 if variant == "gemma3_text" else 40  # two prompts fit, not their replies
    small = engine(num_pages=small_pool, enable_prefix_caching=False)
    small.add_request(requests[0][0], params, request_id="aborted")
    for _ in range(3):
        small.step()
    small.abort("aborted")
    finals = run_to_completion(small, {0: requests})
    assert finals.pop("aborted") is not None and finals == reference
    assert small.scheduler.num_preemptions > 0


QUANT_SIZES = dict(hidden_size=128, intermediate_size=256, head_dim=32, moe_intermediate_size=64)


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_moe", "gemma3_text"])
@pytest.mark.parametrize(("dtype", "tolerance"), [("q8", 0.05), ("q4", 0.6)])
def test_quantized_load_and_run(tmp_path, variant, dtype, tolerance):
    sizes = {k: v for k, v in QUANT_SIZES.items() if k != "moe_intermediate_size" or "moe" in variant}
    hf_checkpoint(tmp_path / "m", variant, std=0.05, **sizes)
    tokens = np.random.default_rng(0).integers(0, 300, 40).tolist()
    reference = load_model(tmp_path / "m", dtype="float32")
    loaded = load_model(tmp_path / "m", dtype=dtype)
    bits = int(dtype[1:])
    assert loaded.model.layers[0].self_attn.q_proj.bits == bits
    if "moe" in variant:
        experts = loaded.model.layers[0].mlp.switch_mlp.down_proj
        assert isinstance(experts, QuantizedSwitchLinear) and experts.bits == bits
    expected = np.array(dense_logits(reference, tokens))
    assert max_diff(dense_logits(loaded, tokens), expected) / np.abs(expected).max() < tolerance
    # and through the paged cache
    assert max_diff(paged_logits(loaded, tokens, 30, 4)[-1], dense_logits(loaded, tokens)[-1]) < 1e-3


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_switch_linear_equals_one_matmul_per_expert(bits):
    """gather_mm / gather_qmm over rows sorted by expert == each row times its own expert's weight."""
    linear = SwitchLinear(num_experts=5, input_dims=64, output_dims=24)
    if bits:
        linear = linear.to_quantized(group_size=64, bits=bits)
        weight = mx.dequantize(linear.weight, linear.scales, linear.biases, group_size=64, bits=bits)
    else:
        weight = linear.weight
    experts = mx.sort(mx.array(np.random.default_rng(0).integers(0, 5, 33)))
    x = mx.random.normal((33, 1, 64))
    expected = mx.stack([x[i] @ weight[int(e)].T for i, e in enumerate(experts.tolist())])
    assert max_diff(linear(x, experts), expected) < 1e-4


def test_moe_experts_run_batched(tmp_path):
    hf_checkpoint(tmp_path / "m", "qwen3_moe")
    model = load_model(tmp_path / "m", dtype="float32")
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.switch_mlp.gate_proj, SwitchLinear)
    assert mlp.switch_mlp.gate_proj.weight.shape == (8, 32, 64)  # [experts, out, in], one gather-matmul
    assert type(model.model.layers[1].mlp).__name__ == "MLP"  # mlp_only_layers


def rewrite_checkpoint(path: Path, rename=None, config=None) -> Path:
    """Rewrite a saved checkpoint in place: `rename(weights) -> weights`, `config(config) -> config`."""
    weights = mx.load(str(path / "model.safetensors"))
    if rename:
        weights = rename(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    if config:
        (path / "config.json").write_text(json.dumps(config(json.loads((path / "config.json").read_text()))))
    return path


def test_packed_and_mlx_lm_expert_layouts_load_alike(tmp_path):
    hf_checkpoint(tmp_path / "m", "qwen3_moe")
    tokens = list(range(20))
    expected = dense_logits(load_model(tmp_path / "m", dtype="float32"), tokens)

    def pack(weights):  # transformers 5.x in memory: [E, 2I, D] gate then up, [E, D, I]
        out = {k: v for k, v in weights.items() if ".experts." not in k}
        for layer in (0, 2):
            prefix = f"model.layers.{layer}.mlp.experts"
            stack = {p: mx.stack([weights[f"{prefix}.{e}.{p}.weight"] for e in range(8)])
                     for p in ("gate_proj", "up_proj", "down_proj")}
            out[f"{prefix}.gate_up_proj"] = mx.concatenate([stack["gate_proj"], stack["up_proj"]], axis=1)
            out[f"{prefix}.down_proj"] = stack["down_proj"]
        return out

    rewrite_checkpoint(tmp_path / "m", pack)
    assert max_diff(dense_logits(load_model(tmp_path / "m", dtype="float32"), tokens), expected) < 1e-5


@pytest.mark.parametrize("layout", ["4.x", "5.x"])
def test_gemma3_with_vision_loads_its_tower_or_nothing(tmp_path, layout):
    """A gemma3 checkpoint loads its text model and its vision tower (tests/test_gemma3_vl.py runs it); one
    whose tower tensors are missing is refused, naming one: nothing loads half."""
    hf_checkpoint(tmp_path / "m", "gemma3_text")
    prefix = "model.language_model." if layout == "5.x" else "language_model.model."
    rewrite_checkpoint(tmp_path / "m", lambda weights: {prefix + k.removeprefix("model."): v for k, v in weights.items()},
                       lambda c: {"model_type": "gemma3", "text_config": c, "mm_tokens_per_image": 4,
                                  "vision_config": {"model_type": "siglip_vision_model", "image_size": 56,
                                                    "patch_size": 14, "hidden_size": 32, "intermediate_size": 64,
                                                    "num_hidden_layers": 1, "num_attention_heads": 2}})
    with pytest.raises(ModelLoadError, match="vision.vision_tower.* is missing"):
        load_model(tmp_path / "m", dtype="float32")


CONFIGS_4X = {  # config.json as transformers 4.x (and the Hub) wrote it
    "qwen2": {"model_type": "qwen2", "rope_theta": 1e6, "use_sliding_window": True, "sliding_window": 8,
              "max_window_layers": 1, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 32}},
    "llama": {"model_type": "llama", "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}},
    "qwen3": {"model_type": "qwen3", "rope_theta": 1e6, "tie_word_embeddings": True},
    "qwen3_moe": {"model_type": "qwen3_moe", "rope_theta": 1e6, **MOE, "norm_topk_prob": True,
                  "mlp_only_layers": [0], "decoder_sparse_step": 1},
    "gemma3_text": {"model_type": "gemma3_text", **GEMMA, "sliding_window_pattern": 2,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
}
CONFIG_CLASSES = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config",
                  "qwen3_moe": "Qwen3MoeConfig", "gemma3_text": "Gemma3TextConfig"}


@pytest.mark.parametrize("model_type", list(CONFIGS_4X))
def test_both_config_styles_parse_to_the_same_arguments(model_type):
    """The 4.x config.json, and what transformers 5.x makes of it (rope_parameters, layer_types)."""
    old = {**COMMON, **CONFIGS_4X[model_type]}
    new = getattr(transformers, CONFIG_CLASSES[model_type])(**copy.deepcopy(old)).to_dict()
    assert "rope_parameters" in new and "rope_theta" not in new
    args = args_from_config(old)
    assert args_from_config(new) == args
    assert args.rope_theta == old["rope_theta"]
    if model_type == "gemma3_text":
        assert args.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
        assert args.rope_local_base_freq == 1e4 and args.rope_scaling == {"rope_type": "linear", "factor": 8.0}
        assert args_from_config({"model_type": "gemma3", "text_config": new}) == args
    if model_type == "qwen2":
        assert args.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
        assert args.sliding_window == 8 and args.rope_scaling["rope_type"] == "yarn"


def test_unsupported_model_type_names_the_supported_families(tmp_path):
    hf_checkpoint(tmp_path / "m", "qwen3")
    rewrite_checkpoint(tmp_path / "m", config=lambda c: {**c, "model_type": "gpt_neox"})
    with pytest.raises(ModelLoadError, match="'gpt_neox' is not supported.*qwen2, llama, qwen3, qwen3_moe, gemma3_text"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize(("variant", "drop", "message"), [
    ("qwen3_moe", "moe_intermediate_size", "lacks 'moe_intermediate_size', which qwen3_moe needs"),
    ("qwen3_moe", "num_local_experts", "lacks 'num_experts'"),
    ("gemma3_text", "sliding_window", "lacks 'sliding_window'"),
    ("qwen3", "hidden_size", "lacks 'hidden_size'"),
])
def test_a_config_missing_a_key_names_it(tmp_path, variant, drop, message):
    hf_checkpoint(tmp_path / "m", variant)
    rewrite_checkpoint(tmp_path / "m", config=lambda c: {k: v for k, v in c.items() if k != drop})
    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path / "m")


def test_unsupported_settings_are_refused(tmp_path):
    hf_checkpoint(tmp_path / "m", "gemma3_text")
    rewrite_checkpoint(tmp_path / "m", config=lambda c: {**c, "attn_logit_softcapping": 50.0})
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping=50.0 is not supported"):
        load_model(tmp_path / "m")


def _drop(name):
    return lambda w: {k: v for k, v in w.items() if k != name}


@pytest.mark.parametrize(("variant", "rename", "message"), [
    ("qwen3", _drop("model.layers.1.self_attn.k_norm.weight"), "model.layers.1.self_attn.k_norm.weight is missing"),
    ("qwen3", lambda w: {**w, "model.layers.0.mlp.up_proj.weight": mx.zeros((128, 65))},
     r"model.layers.0.mlp.up_proj.weight has shape \(128, 65\), the architecture needs \(128, 64\)"),
    ("gemma3_text", lambda w: {**w, "model.layers.0.self_attn.q_proj.bias": mx.zeros((64,))},
     "model.layers.0.self_attn.q_proj.bias is not part of it"),
    ("qwen3_moe", _drop("model.layers.2.mlp.experts.5.up_proj.weight"),
     "lacks model.layers.2.mlp.experts.5.up_proj.weight .the model has 8 experts"),
])
def test_weights_that_do_not_fit_name_the_first_tensor(tmp_path, variant, rename, message):
    hf_checkpoint(tmp_path / "m", variant)
    rewrite_checkpoint(tmp_path / "m", rename)
    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path / "m")
