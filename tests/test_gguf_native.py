"""dtype="native": a GGUF's own quantization on MLX's quantized layers, against gguf-py's float dequantization.

Tiny random GGUFs hold every quant type: the types gguf-py quantizes from random floats, the others
(K-quants, IQ4) as random blocks with finite float16 scales. The reference is always the float32
load of the very same file (which test_loader proves equal to transformers' GGUF load).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten
from test_tensor_parallel import TP, load_engine, mixed_batches  # its ranks start once per test process
from tiny_models import dense_logits

from tinymlx import LLM, SamplingParams
from tinymlx.core import dtypes
from tinymlx.loader import convert_gguf, load_weights, resolve_model_dir
from tinymlx.loader.cache import list_cached_models
from tinymlx.loader.gguf_file import num_weights
from tinymlx.loader.gguf_quant import MAX_ERROR, native_bits, to_native
from tinymlx.models import activation_dtype, check_tensor_parallel, load_model
from tinymlx.text.tokenizer import Tokenizer

EXACT = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K]
REQUANTIZED = [T.Q6_K, T.Q3_K, T.Q2_K, T.IQ4_NL, T.IQ4_XS]
BITS = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q4_K: 4, T.Q5_K: 5}
QUANTIZABLE = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}  # gguf.quants.quantize writes these
# Random blocks: (byte offset, value) of each float16 scale, sized so weights stay within about +-0.2.
RAW_SCALES = {
    T.Q4_K: [(0, 2e-4), (2, 1e-3)], T.Q5_K: [(0, 1e-4), (2, 1e-3)], T.Q6_K: [(208, 4e-5)],
    T.Q3_K: [(108, 1e-3)], T.Q2_K: [(80, 3e-3), (82, 5e-3)], T.IQ4_NL: [(0, 1e-3)], T.IQ4_XS: [(0, 4e-5)],
}
TOKENS = np.random.default_rng(1).integers(0, 320, 24).tolist()
VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 320, 256, 512, 4, 2, 64  # K-quant rows: multiples of 256
NUM_EXPERTS, EXPERT_FFN = 4, 256


def quantized_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A [rows, cols] tensor of `qtype` as GGUF stores it: uint8 [rows, bytes per row]."""
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(rng.normal(0, 0.08, (rows, cols)).astype(np.float32), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for at, scale in RAW_SCALES[qtype]:
        values = scale * rng.uniform(0.5, 1.5, (len(blocks), 1))
        blocks[:, at:at + 2] = values.astype(np.float16).view(np.uint8)
    return raw


def mx_dequantize(native) -> np.ndarray:
    """MLX's float32 dequantization, as quantized_matmul computes with 16-bit scales too."""
    scales, biases = (mx.array(a).astype(mx.float32) for a in (native.scales, native.biases))
    return np.array(mx.dequantize(mx.array(native.weight), scales, biases, group_size=32, bits=native.bits))


@pytest.mark.parametrize("qtype", EXACT + REQUANTIZED, ids=lambda t: t.name)
def test_each_type_maps_onto_mlx_within_its_recorded_error(qtype):
    raw = quantized_blocks(qtype, 64, 512, np.random.default_rng(0))
    native = to_native(raw, qtype, (64, 512))
    assert native.bits == BITS.get(qtype, 8) == native_bits(qtype)
    assert native.weight.dtype == np.uint32 and native.weight.shape == (64, 512 * native.bits // 32)
    assert native.scales.shape == native.biases.shape == (64, 16)
    # 16-bit where a float16 holds every scale and bias exactly: not the K-quants' d * sc
    assert native.scales.dtype == native.biases.dtype == (np.float32 if qtype in (T.Q4_K, T.Q5_K) else np.float16)
    expected, ours = gguf.quants.dequantize(raw, qtype), mx_dequantize(native)
    if MAX_ERROR[qtype.name] == 0:
        np.testing.assert_array_equal(ours, expected)  # bit for bit
        return
    groups, error = expected.reshape(-1, 32), np.abs(ours - expected).reshape(-1, 32).max(axis=1)
    lo = groups.min(axis=1)
    bias_rounding = lo - native.biases.reshape(-1).astype(np.float32)  # down to a float16
    assert (bias_rounding >= 0).all() and (bias_rounding <= np.spacing(np.abs(lo).astype(np.float16))).all()
    float_rounding = 4 * np.finfo(np.float32).eps * np.abs(groups).max(axis=1)
    bound = MAX_ERROR[qtype.name] * (groups.max(axis=1) - lo + bias_rounding) * (1 + 2**-10) + float_rounding
    assert (error <= bound).all()
    assert error.max() > 0.9 * bound.max()  # the bound is the real one, not slack


def test_float_types_stay_float():
    assert [native_bits(t) for t in (T.F32, T.F16, T.BF16)] == [None, None, None]


# ---- tiny GGUF models of every family's storage tricks: Llama's permuted Q/K, Gemma's norms + 1, tied embeddings ----

def write_gguf(path: Path, arch: str, qtype_of, tied: bool = False, num_layers: int = 2, seed: int = 0) -> Path:
    """A random `arch` GGUF; `qtype_of(name)` picks each matrix's type (None: F32). Norms and biases are F32.
    qwen3moe's layers hold 4 experts (2 per token) of width 256, stacked [experts, out, in]."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_sliding_window(8)
    if arch == "qwen3moe":
        writer.add_expert_count(NUM_EXPERTS)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(EXPERT_FFN)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    shift = 1.0 if arch == "gemma3" else 0.0  # llama.cpp stores Gemma's norms as 1 + w
    norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if arch == "gemma3" else [])
    matrices = {"token_embd": (VOCAB, HIDDEN)} | ({} if tied else {"output": (VOCAB, HIDDEN)})
    vectors = {"output_norm.weight": HIDDEN}
    for i in range(num_layers):
        matrices |= {f"blk.{i}.attn_q": (HEADS * HEAD_DIM, HIDDEN), f"blk.{i}.attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
                     f"blk.{i}.attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), f"blk.{i}.attn_output": (HIDDEN, HEADS * HEAD_DIM),
                     f"blk.{i}.ffn_gate": (FFN, HIDDEN), f"blk.{i}.ffn_up": (FFN, HIDDEN), f"blk.{i}.ffn_down": (HIDDEN, FFN)}
        if arch == "qwen3moe":  # the router stays F32, as llama.cpp keeps it
            for name in ("ffn_gate", "ffn_up", "ffn_down"):
                del matrices[f"blk.{i}.{name}"]
            matrices |= {f"blk.{i}.ffn_gate_exps": (NUM_EXPERTS, EXPERT_FFN, HIDDEN),
                         f"blk.{i}.ffn_up_exps": (NUM_EXPERTS, EXPERT_FFN, HIDDEN),
                         f"blk.{i}.ffn_down_exps": (NUM_EXPERTS, HIDDEN, EXPERT_FFN)}
            vectors[f"blk.{i}.ffn_gate_inp.weight"] = None
        vectors |= {f"blk.{i}.{norm}.weight": HIDDEN for norm in norms}
        if arch != "llama":
            vectors |= {f"blk.{i}.attn_q_norm.weight": HEAD_DIM, f"blk.{i}.attn_k_norm.weight": HEAD_DIM}
    for name, shape in matrices.items():
        qtype = qtype_of(name)
        if qtype is None:
            writer.add_tensor(f"{name}.weight", rng.normal(0, 0.08, shape).astype(np.float32))
        else:
            blocks = quantized_blocks(qtype, int(np.prod(shape[:-1])), shape[-1], rng)
            writer.add_tensor(f"{name}.weight", blocks.reshape(*shape[:-1], -1), raw_dtype=qtype)
    for name, size in vectors.items():
        if size is None:  # the MoE router
            writer.add_tensor(name, rng.normal(0, 0.3, (NUM_EXPERTS, HIDDEN)).astype(np.float32))
        else:
            writer.add_tensor(name, (shift + 1 + rng.normal(0, 0.1, size)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def load_both(path: Path):
    """The native and the float32 model of one GGUF."""
    native_dir, float_dir = convert_gguf(path, progress=False, dtype="native"), convert_gguf(path, progress=False)
    return load_model(native_dir, "native"), load_model(float_dir, "float32"), native_dir, float_dir


def max_logit_error(native, reference) -> float:
    ours, expected = np.array(dense_logits(native, TOKENS)), np.array(dense_logits(reference, TOKENS))
    return float(np.abs(ours - expected).max() / np.abs(expected).max())


def dequantized(layer: nn.Module) -> mx.array:
    """A quantized layer's weights in float32, as its matmul computes with them (16-bit scales included)."""
    scales, biases = layer.scales.astype(mx.float32), layer.biases.astype(mx.float32)
    return mx.dequantize(layer.weight, scales, biases, group_size=layer.group_size, bits=layer.bits)


def with_native_weights(reference, native):
    """`reference`, a float32 model, with each of `native`'s quantized layers' weights as mx.dequantize gives them."""
    modules = dict(reference.named_modules())
    for path, layer in native.named_modules():
        if "scales" in layer:  # QuantizedLinear, QuantizedEmbedding, QuantizedSwitchLinear
            weight = dequantized(layer)
            if "weight_t" in modules[path]:  # the CPU's float32 [in, out] layout
                modules[path].weight_t = mx.contiguous(weight.T)
            else:
                modules[path].weight = weight
    return reference


# Where the mapping is exact, logits differ by the summation order of quantized and BLAS matmuls alone
# (measured: below 2e-6 of the largest logit). Where weights are rounded to 8 bits (at most 1/510 of a
# group's range), logits of these random 2-layer models moved by 0.6-2.4% (measured); against a float
# model holding the rounded weights themselves they match to summation order again.
EXACT_LOGITS, REQUANTIZED_LOGITS = 2e-5, 0.05


def assert_logits_match(native, reference, exact: bool) -> None:
    error = max_logit_error(native, reference)
    if exact:
        assert error < EXACT_LOGITS, error
    else:
        assert error < REQUANTIZED_LOGITS, error
        assert max_logit_error(native, with_native_weights(reference, native)) < EXACT_LOGITS


@pytest.mark.parametrize("qtype", EXACT + REQUANTIZED, ids=lambda t: t.name)
def test_native_logits_equal_the_float_models(tmp_path, cache, qtype):
    """Llama: every matrix of `qtype`, its Q/K rows permuted in the file (whole rows of codes, scales, biases)."""
    native, reference, _, float_dir = load_both(write_gguf(tmp_path / "m.gguf", "llama", lambda _: qtype))
    q_proj = native.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.bits == BITS.get(qtype, 8) and q_proj.group_size == 32
    assert isinstance(native.model.embed_tokens, nn.QuantizedEmbedding) and isinstance(native.lm_head, nn.QuantizedLinear)
    weights = load_weights(float_dir)
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.0.mlp.down_proj"):
        error = float(mx.abs(dequantized(dict(native.named_modules())[name]) - weights[f"{name}.weight"]).max())
        assert error == 0 if qtype in EXACT else 0 < error < 0.01, (name, error)
    assert_logits_match(native, reference, qtype in EXACT)


MIXED = {"token_embd": T.Q6_K, "blk.0.attn_q": T.Q4_K, "blk.0.attn_k": T.Q5_0, "blk.0.attn_v": T.Q8_0,
         "blk.0.ffn_down": T.Q6_K, "blk.1.attn_output": None, "blk.1.ffn_up": T.Q5_K}


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_each_layer_keeps_its_own_types_bits_and_a_tied_embedding_is_the_lm_head(tmp_path, cache, arch):
    """Q4_K_M-style mixes, a tied quantized embedding; Gemma's norms lose their stored 1 (float norms only)."""
    path = write_gguf(tmp_path / "m.gguf", arch, lambda name: MIXED.get(name, T.Q4_0), tied=True)
    native, reference, native_dir, _ = load_both(path)
    modules = dict(native.named_modules())
    for name, qtype in MIXED.items():
        hf = gguf_arch_name(name)
        if qtype is None:
            assert type(modules[hf]).__name__ == "CPULinear", hf  # a float matrix stays float (the CPU's linear)
        else:
            assert modules[hf].bits == BITS.get(qtype, 8) and modules[hf].group_size == 32, hf
    assert "lm_head" not in native and isinstance(native.model.embed_tokens, nn.QuantizedEmbedding)
    assert native.model.embed_tokens.bits == 8
    norm = native.model.layers[0].input_layernorm.weight
    assert mx.array_equal(norm, reference.model.layers[0].input_layernorm.weight) and float(norm.mean()) < 1.5
    assert_logits_match(native, reference, exact=False)  # the embedding and a down_proj are Q6_K
    quantization = json.loads((native_dir / "config.json").read_text())["quantization"]
    assert quantization["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 4}
    assert "model.layers.1.self_attn.o_proj" not in quantization


def test_moe_experts_keep_their_types(tmp_path, cache):
    """Qwen3-MoE's stacked experts [E, out, in] as gather_qmm's quantized weights, each projection its own type."""
    types = {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q5_0, "ffn_down_exps": T.Q6_K}
    path = write_gguf(tmp_path / "m.gguf", "qwen3moe", lambda name: types.get(name.split(".")[-1], T.Q8_0))
    native, reference, _, _ = load_both(path)
    experts = native.model.layers[1].mlp.switch_mlp
    assert [(experts[p].bits, experts[p].weight.shape) for p in ("gate_proj", "up_proj", "down_proj")] == [
        (4, (NUM_EXPERTS, EXPERT_FFN, HIDDEN * 4 // 32)), (5, (NUM_EXPERTS, EXPERT_FFN, HIDDEN * 5 // 32)),
        (8, (NUM_EXPERTS, HIDDEN, EXPERT_FFN * 8 // 32))]
    assert type(native.model.layers[0].mlp.gate).__name__ == "CPULinear"  # the F32 router stays float
    assert_logits_match(native, reference, exact=False)


def gguf_arch_name(name: str) -> str:
    parts = {"token_embd": "model.embed_tokens", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_down": "mlp.down_proj",
             "ffn_up": "mlp.up_proj"}
    if name in parts:
        return parts[name]
    _, layer, part = name.split(".")
    return f"model.layers.{layer}.{parts[part]}"


def test_the_native_copy_holds_no_float_copy_and_is_listed(tmp_path, cache):
    path = write_gguf(tmp_path / "tiny.gguf", "qwen3", lambda _: T.Q4_K)
    native_dir = convert_gguf(path, progress=False, dtype="native")
    assert native_dir.name.endswith("-native") and native_dir.parent == cache / "converted"
    stored = load_weights(native_dir)
    assert all(array.dtype == mx.uint32 for name, array in stored.items() if name.endswith(".weight") and array.ndim > 1)
    assert (native_dir / "model.safetensors").stat().st_size < 1.4 * path.stat().st_size  # float32 scales and biases
    float_dir = convert_gguf(path, progress=False)
    tiny = next(m for m in list_cached_models() if m.name == "tiny")
    assert [(c.path, c.dtype, c.state) for c in tiny.conversions] == [(float_dir, "float32", "ready"),
                                                                      (native_dir, "native", "ready")]
    assert resolve_model_dir(str(path), progress=False, dtype="native") == native_dir
    assert num_weights(path) == sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(path).tensors)


def test_auto_is_float32_on_the_cpu_while_it_fits_and_native_when_it_does_not(tmp_path, cache, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf", "qwen3", lambda _: T.Q8_0)
    assert mx.default_device() == mx.cpu
    float_bytes = 4 * num_weights(path)
    assert resolve_model_dir(str(path), progress=False, dtype="auto") == convert_gguf(path, progress=False)
    assert dtypes.resolve_dtype("auto", float_bytes) == "float32"
    monkeypatch.setattr(dtypes, "ram_bytes", lambda: 2 * float_bytes - 1)  # float32 would take over half the RAM
    assert dtypes.resolve_dtype("auto", float_bytes) == "native"
    native_dir = resolve_model_dir(str(path), progress=False, dtype="auto")
    assert native_dir.name.endswith("-native")
    model = load_model(native_dir, "auto")  # a quantized checkpoint loads as stored
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert model.model.layers[0].mlp.up_proj.scales.dtype == mx.float16  # Q8_0's d as stored: exact, half the bytes
    assert model.model.embed_tokens.scales.dtype == mx.float32 and activation_dtype(model) == mx.float32
    with monkeypatch.context() as gpu:
        gpu.setattr(dtypes.mx, "default_device", lambda: mx.Device(mx.gpu))
        assert dtypes.resolve_dtype("auto") == "native" and dtypes.native_float_dtype() == mx.bfloat16


def test_tensor_parallel_shards_hold_whole_groups_of_32(tmp_path, cache):
    """A native copy's layers split like q4/q8 ones (MLX's shard_inplace knows the packed layout): each
    rank's slice of a row-parallel layer must hold whole groups of 32, checked before any rank starts."""
    native_dir = convert_gguf(write_gguf(tmp_path / "m.gguf", "qwen3", lambda _: T.Q4_0), progress=False, dtype="native")
    check_tensor_parallel(native_dir, "native", 2)  # o_proj 128 and down_proj 256 inputs per rank: whole groups
    config = json.loads((native_dir / "config.json").read_text())
    config.update(num_attention_heads=16, num_key_value_heads=16, head_dim=16)  # o_proj: 256 inputs, 16 per rank
    (native_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="o_proj's 16 input features per rank, not a multiple of the quantization "
                       "group size 32"):
        check_tensor_parallel(native_dir, "native", 16)


def test_tensor_parallel_native_forward_equals_single_process(tmp_path, cache):
    native_dir = convert_gguf(write_gguf(tmp_path / "m.gguf", "qwen3", lambda name: MIXED.get(name, T.Q4_0)),
                              progress=False, dtype="native")
    single, sharded = load_engine(native_dir, dtype="native"), load_engine(native_dir, TP, dtype="native")
    try:
        whole, split = (engine.runner.model.model.layers[0] for engine in (single, sharded))
        assert split.self_attn.q_proj.bits == 4 and split.self_attn.k_proj.bits == 5  # each layer's own bits
        assert split.self_attn.q_proj.weight.shape[0] * TP == whole.self_attn.q_proj.weight.shape[0]
        assert split.mlp.down_proj.linear.bits == 8  # Q6_K, row-parallel: half of each row's groups
        assert split.mlp.down_proj.linear.scales.shape[1] * TP == whole.mlp.down_proj.scales.shape[1]
        for batch in mixed_batches(len(single.runner.kv_groups)):
            expected, logits = np.array(single.runner.run(batch)), np.array(sharded.runner.run(batch))
            assert logits.shape == expected.shape and np.abs(logits - expected).max(initial=0) < 1e-4
    finally:
        sharded.close()


# A short system prompt of our own in place of Qwen's default one: on the CPU a native prefill costs about
# 0.4 s a token (quantized matmuls never reach BLAS), and decoding the three 0.9 s a step.
SYSTEM = {"role": "system", "content": "Be concise."}
CHATS = [
    [SYSTEM, {"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
    [SYSTEM, {"role": "user", "content": "What is the difference between a list and a tuple in Python? One sentence."}],
    [SYSTEM, {"role": "user", "content": "Explain what a SQL JOIN does."}],
]


@pytest.mark.real_model
def test_real_q4_k_m_model_greedy_equals_transformers_within_1_3x_the_file(default_gguf, default_model_dir):
    """Qwen2.5-Coder-0.5B Q4_K_M (Q5_0, Q8_0, Q4_K exact; Q6_K ffn_down in 8 bits). The reference is
    transformers on the float32 conversion, which equals its own GGUF load (test_loader)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    native_dir = convert_gguf(default_gguf, progress=False, dtype="native")
    tokenizer = Tokenizer.from_dir(native_dir)
    prompts = [tokenizer.apply_chat_template(chat) for chat in CHATS]
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = reference.generate(ids, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(ids))
            expected.append(out[0, len(prompt):].tolist())
    del reference
    gc.collect()

    llm = LLM(str(native_dir), dtype="native", num_pages=64, progress=False)
    try:
        model = llm.engine.runner.model
        assert isinstance(model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
        assert weights_bytes(model) <= 1.3 * default_gguf.stat().st_size  # measured: 1.14x (16-bit scales kept)
        outs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=16))
        for out, tokens in zip(outs, expected):
            assert out.token_ids == tokens[: len(out.token_ids)]
            assert len(out.token_ids) == 16 or out.finish_reason == "stop"
    finally:
        llm.close()
        mx.clear_cache()


def weights_bytes(model) -> int:
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))
