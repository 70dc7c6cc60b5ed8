"""The kernels model code runs through (ops/kernels.py): which set a load chooses, the portable attention
against the CPU's, the CPU's linears against MLX's, and a portable forward that never evaluates inside the
model."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny_models import tiny_model

from tinymlx.core.batch import ScheduledBatch, ScheduledChunk
from tinymlx.core.config import EngineConfig
from tinymlx.models import build_model
from tinymlx.ops import cpu, kernels, portable
from tinymlx.ops.attention import QuantizedKV, visible_keys
from tinymlx.ops.cpu import host_math, linear, rows_kernel
from tinymlx.ops.cpu.linear import CPUEmbedding, CPULinear
from tinymlx.runner.model_runner import ModelRunner


@pytest.fixture(autouse=True)
def kernels_come_back():
    found = kernels.chosen()
    yield
    kernels.use(found)


def test_a_load_chooses_the_cpu_kernels_on_the_cpu_unless_told_the_portable_ones(monkeypatch):
    monkeypatch.delenv(kernels.PORTABLE_ENV, raising=False)
    assert kernels.choose() is cpu.KERNELS
    assert kernels.choose(force_portable=True) is portable.KERNELS
    monkeypatch.setenv(kernels.PORTABLE_ENV, "1")
    build_model(tiny_model().args)  # building a model is when the choice is made
    assert kernels.chosen() is portable.KERNELS
    monkeypatch.setenv(kernels.PORTABLE_ENV, "0")
    assert kernels.choose() is cpu.KERNELS


def test_a_gpu_never_takes_the_cpu_kernels(monkeypatch):
    monkeypatch.delenv(kernels.PORTABLE_ENV, raising=False)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert kernels.choose() is portable.KERNELS
    assert kernels.choose(force_portable=False) is portable.KERNELS


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize(("L", "window"), [(1, None), (9, None), (9, 5), (80, None)])  # 80: int8 dequantizes on the CPU
def test_portable_attention_equals_the_cpus(kv_dtype, L, window, monkeypatch):
    """q [B, L, H, D] over K/V [KV, B, T, D] of 4 query heads per KV head, causal or windowed; the CPU's
    with numpy's softmax and with the power of two."""
    rng = np.random.default_rng(L)
    B, H, KV, D, T = 2, 8, 2, 64, 96
    q = mx.array(rng.normal(0, 1, (B, L, H, D)).astype(np.float32))
    k, v = (mx.array(rng.normal(0, 1, (KV, B, T, D)).astype(np.float32)) for _ in range(2))
    positions = mx.array(np.arange(T - L, T))[None] + mx.zeros((B, 1), mx.int32)
    visible = visible_keys(positions, mx.broadcast_to(mx.arange(T)[None], (B, T)), window)
    if kv_dtype == "int8":
        k, v = (QuantizedKV(*mx.quantize(x, group_size=32, bits=8), 32) for x in (k, v))
    expected = portable.KERNELS.attention(q, k, v, visible, D**-0.5)
    assert expected.shape == (B, L, H, D)
    for min_values in (0, 1 << 62):
        monkeypatch.setattr(host_math, "MIN_VALUES", min_values)
        assert float(mx.abs(cpu.KERNELS.attention(q, k, v, visible, D**-0.5) - expected).max()) < 1e-5


@pytest.mark.parametrize("tile_scores", [1 << 24, 3 * 40 * 7])  # one tile; tiles of 7 queries, the last short
def test_dense_attention_of_the_cpu_equals_the_portable_one(tile_scores, monkeypatch):
    """A vision tower's attention (every query sees every key) through numpy's softmax and the power of two."""
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.normal(0, 1, (2, 3, 40, 16)).astype(np.float32)) for _ in range(3))
    expected = portable.KERNELS.dense_attention(q, k, v, 0.25)
    monkeypatch.setattr(cpu, "_DENSE_TILE_SCORES", tile_scores)
    for min_values in (0, 1 << 62):
        monkeypatch.setattr(host_math, "MIN_VALUES", min_values)
        assert float(mx.abs(cpu.KERNELS.dense_attention(q, k, v, 0.25) - expected).max()) < 1e-5


def sink_reference(q, k, v, visible, scale, sinks) -> np.ndarray:
    """numpy, head by head: softmax over the visible scores and the head's sink, the sink's weight dropped."""
    q, k, v, visible, sinks = (np.array(x, dtype=np.float64) for x in (q, k, v, visible, sinks))
    B, L, H, D = q.shape
    group = H // k.shape[0]
    out = np.zeros_like(q)
    for h in range(H):
        scores = np.einsum("bld,btd->blt", q[:, :, h], k[h // group]) * scale
        scores = np.where(visible > 0, scores, -np.inf)
        top = np.maximum(scores.max(-1, keepdims=True), sinks[h])
        weights = np.exp(scores - top)
        out[:, :, h] = weights @ v[h // group] / (weights.sum(-1, keepdims=True) + np.exp(sinks[h] - top))
    return out


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("L", [1, 9, 80])
def test_attention_sinks_take_their_mass_in_every_path(kv_dtype, L, monkeypatch):
    """A learned logit per head joins each softmax before it is normalised and adds no value (gpt-oss): the
    portable path (SDPA's sinks; the grouped form for int8) and the CPU's, both of its softmaxes, against
    numpy. Sinks from -3 to 6 take from almost none of the mass to most of it."""
    rng = np.random.default_rng(L)
    B, H, KV, D, T = 2, 8, 2, 32, L + 16
    q = mx.array(rng.normal(0, 1, (B, L, H, D)).astype(np.float32))
    k, v = (mx.array(rng.normal(0, 1, (KV, B, T, D)).astype(np.float32)) for _ in range(2))
    sinks = mx.array(np.linspace(-3, 6, H).astype(np.float32))
    positions = mx.array(np.arange(T - L, T))[None] + mx.zeros((B, 1), mx.int32)
    visible = visible_keys(positions, mx.broadcast_to(mx.arange(T)[None], (B, T)), None)
    expected = sink_reference(q, k, v, visible, D**-0.5, sinks)
    if kv_dtype == "int8":
        k, v = (QuantizedKV(*mx.quantize(x, group_size=32, bits=8), 32) for x in (k, v))
        k_ref, v_ref = (mx.dequantize(x.codes, x.scales, x.biases, group_size=32, bits=8) for x in (k, v))
        expected = sink_reference(q, k_ref, v_ref, visible, D**-0.5, sinks)
    without = sink_reference(q, k, v, visible, D**-0.5, mx.full((H,), -np.inf)) if kv_dtype == "float32" else None
    results = [portable.KERNELS.attention(q, k, v, visible, D**-0.5, sinks)]
    for min_values in (0, 1 << 62):  # numpy's softmax and the power of two
        monkeypatch.setattr(host_math, "MIN_VALUES", min_values)
        results.append(cpu.KERNELS.attention(q, k, v, visible, D**-0.5, sinks))
    for result in results:
        assert np.abs(np.array(result) - expected).max() < 1e-4
    if without is not None:  # the sinks matter: without them (or after normalising) the output is another
        assert np.abs(expected - without).max() > 0.1


@pytest.mark.parametrize(("name", "args"), [("exp", 1), ("sigmoid", 1), ("silu", 1), ("silu_mul", 2),
                                            ("gelu_tanh_mul", 2)])
def test_portable_and_cpu_elementwise_kernels_agree(name, args):
    rng = np.random.default_rng(0)
    xs = [mx.array(rng.normal(0, 4, (7, 300)).astype(np.float32)) for _ in range(args)]
    a, b = getattr(portable.KERNELS, name)(*xs), getattr(cpu.KERNELS, name)(*xs)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert float((mx.abs(a - b) / (1 + mx.abs(a))).max()) < 1e-5


SLIDING = {"sliding_window": 6, "sliding_window_pattern": 2}


@pytest.mark.parametrize(("model_type", "overrides", "forced_numpy"), [
    ("qwen2", {}, False), ("gemma3_text", SLIDING, False), ("qwen2", {}, True)])
def test_the_portable_forward_never_evaluates_inside_the_model(monkeypatch, model_type, overrides, forced_numpy):
    """The paged forward builds its graph without one evaluation on the portable path; the CPU's numpy
    kernels do evaluate (so the check can fail)."""
    model = tiny_model(model_type=model_type, **overrides)
    kernels.use(cpu.KERNELS if forced_numpy else portable.KERNELS)
    monkeypatch.setattr(host_math, "MIN_VALUES", 0)
    config = EngineConfig(block_size=4, num_pages=16).resolve(model.args, mx.float32, model.layer_specs())
    runner = ModelRunner(model, config)
    tables = (tuple(range(5)),) * len(runner.kv_groups)
    inputs = runner.prepare(ScheduledBatch([ScheduledChunk(0, list(range(1, 20)), 0, tables, True)], 19, []))
    runner.forward(inputs)  # the pool grows to the blocks the step reaches

    def no_eval(*arrays):
        raise AssertionError("an evaluation inside the forward")

    monkeypatch.setattr(mx, "eval", no_eval)
    if forced_numpy:
        with pytest.raises(AssertionError, match="inside the forward"):
            runner.forward(inputs)
        return
    hidden = runner.forward(inputs)
    monkeypatch.undo()
    mx.eval(hidden)
    assert hidden.shape == (1, model.args.hidden_size)


@pytest.mark.parametrize("input_major", [False, True])
def test_the_cpus_linears_give_one_row_through_numpy_what_mlx_gives(input_major, monkeypatch):
    """One float32 row (a single stream's decode) goes through numpy's gemv, 2-8 rows over HF's layout
    through the few-row kernels (rows_kernel.py), more rows through MLX's matmul: all equal nn.Linear's
    values, bias and leading axes included, in either layout, at a width that is a multiple of neither
    kernel's outputs per pass; a tied embedding's lookup and lm_head too."""
    rng = np.random.default_rng(0)
    linear = nn.Linear(48, 83, bias=True)
    linear.update({"weight": mx.array(rng.normal(0, 1, (83, 48)).astype(np.float32)),
                   "bias": mx.array(rng.normal(0, 1, 83).astype(np.float32))})
    embedding = nn.Embedding(83, 48)
    embedding.weight = linear.weight
    ours, tied = CPULinear(linear, input_major), CPUEmbedding(embedding, input_major)
    through_numpy, through_kernel = [], []
    row_times, rows_times = host_math.row_times, host_math.rows_times
    monkeypatch.setattr(host_math, "row_times", lambda x, *rest: through_numpy.append(x.shape) or row_times(x, *rest))
    monkeypatch.setattr(host_math, "rows_times", lambda x, *rest: through_kernel.append(x.shape) or rows_times(x, *rest))
    for shape in [(1, 48), (1, 1, 48), (2, 48), (3, 1, 48), (4, 48), (5, 48), (8, 48), (9, 48)]:
        x = mx.array(rng.normal(0, 1, shape).astype(np.float32))
        for got, expected in ((ours(x), linear(x)), (tied.as_linear(x), embedding.as_linear(x))):
            assert got.shape == expected.shape and float(mx.abs(got - expected).max()) < 1e-4
    assert through_numpy == [(1, 48), (1, 48), (1, 1, 48), (1, 1, 48)]
    few = [(2, 48), (3, 1, 48), (4, 48), (5, 48), (8, 48)]
    assert through_kernel == ([] if input_major else [shape for shape in few for _ in range(2)])
    tokens = mx.array([3, 0, 79])
    assert mx.array_equal(tied(tokens), embedding(tokens))


def test_without_numba_a_few_rows_stay_in_mlx_and_layouts_are_timed(monkeypatch):
    """Where numba is missing the few-row kernels are never called (2-8 rows multiply in MLX, with the same
    values), and a load times each weight's layout again instead of keeping HF's."""
    monkeypatch.setattr(rows_kernel, "_NUMBA_INSTALLED", False)
    monkeypatch.setattr(rows_kernel, "times", lambda *args: pytest.fail("the kernel ran without numba"))
    timed = []
    monkeypatch.setattr(linear, "input_major_is_faster", lambda weight: timed.append(weight.shape) or False)
    rng = np.random.default_rng(1)
    layer = nn.Linear(48, 83, bias=False)
    layer.weight = mx.array(rng.normal(0, 1, (83, 48)).astype(np.float32))
    x = mx.array(rng.normal(0, 1, (4, 48)).astype(np.float32))
    assert not host_math.is_few_rows(x)
    assert float(mx.abs(CPULinear(layer, False)(x) - layer(x)).max()) < 1e-4
    assert not linear.layout_is_input_major(layer.weight, None) and timed == [(83, 48)]
    assert linear.layout_is_input_major(layer.weight, "input_major") and timed == [(83, 48)]  # pinned: not timed
