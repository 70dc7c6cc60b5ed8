"""The CPU's one-row step (runner/cpu_row_step.py) against the model's graph: a single stream decoded through
numpy gives the graph's tokens, logprobs and pool contents, for every model it takes (RoPE kinds, q/k
norms, biases, tied heads, sliding windows, both weight layouts, overlapped steps), and is never taken for
a model or a step it does not run."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny_models import ByteTokenizer, tiny_model

from tinymlx import SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.ops import kernels
from tinymlx.ops.cpu.linear import LINEAR_LAYOUT_ENV, use_cpu_linears
from tinymlx.runner.cpu_row_step import CPURowStep

MODELS = {
    "qwen2": dict(),  # q/k/v bias, an untied lm_head
    "llama, llama3 RoPE, tied": dict(model_type="llama", tie_word_embeddings=True, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)),
    "qwen3, yarn RoPE": dict(model_type="qwen3", rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                                   original_max_position_embeddings=16)),
    "llama, linear RoPE, tanh GELU": dict(model_type="llama", hidden_act="gelu_pytorch_tanh",
                                          rope_scaling=dict(rope_type="linear", factor=2.0)),
    "qwen2, a sliding window of 8": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
}
PROMPT = list(range(40, 53))
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)


@pytest.fixture(autouse=True)
def cpu_kernels(monkeypatch):
    found = kernels.chosen()
    monkeypatch.delenv(kernels.PORTABLE_ENV, raising=False)
    kernels.choose()
    yield
    kernels.use(found)


def engine_of(model, **config) -> Engine:
    config = dict(block_size=4, num_pages=64, enable_prefix_caching=False) | config
    return Engine(model, ByteTokenizer(), EngineConfig(**config), model_name="tiny")


def decode(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list, list]:
    """One request to its end, check() after every step: (its tokens, its logprobs)."""
    engine.add_request(prompt, params, request_id="r")
    final = None
    while engine.has_unfinished_requests:
        for output in engine.step():
            final = output if output.finished else final
        engine.check()
    return final.token_ids, final.logprobs


def row_steps_counted(engine: Engine) -> list[int]:
    """A list that grows by one each time the engine's one-row step runs."""
    step, counts = engine.runner.step_backend, []

    def counting(row):
        counts.append(row.position)
        return CPURowStep.row_logits(step, row)

    step.row_logits = counting
    return counts


def through_the_graph(engine: Engine) -> None:
    engine.runner.step_backend = engine.runner.graph_logits


def takes_rows(engine: Engine) -> bool:
    """Whether the engine's step backend runs one-row steps in numpy."""
    backend = engine.runner.step_backend
    return isinstance(backend, CPURowStep) and backend.row_model is not None


def assert_same(got: tuple[list, list], expected: tuple[list, list]) -> None:
    assert got[0] == expected[0]
    for a, b in zip(got[1], expected[1], strict=True):
        assert a.token_id == b.token_id and [i for i, _ in a.top] == [i for i, _ in b.top]
        np.testing.assert_allclose([a.logprob, *(lp for _, lp in a.top)], [b.logprob, *(lp for _, lp in b.top)],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["as built", "input_major", "hf"])
@pytest.mark.parametrize("name", MODELS)
def test_a_single_stream_through_numpy_equals_the_graph(name, layout, monkeypatch):
    model = tiny_model(seed=3, **MODELS[name])
    if layout != "as built":  # the CPULinear layouts a load converts to (nn.Linear as built otherwise)
        monkeypatch.setenv(LINEAR_LAYOUT_ENV, layout)
        use_cpu_linears(model)
    numpy_engine, graph_engine = engine_of(model), engine_of(model)
    through_the_graph(graph_engine)
    counts = row_steps_counted(numpy_engine)
    got = decode(numpy_engine, PROMPT)
    assert counts == list(range(len(PROMPT), len(PROMPT) + GREEDY.max_tokens - 1))  # every decode step
    assert_same(got, decode(graph_engine, PROMPT))
    # Every K/V it wrote is where the graph wrote it (the same blocks: both pools were handed out alike).
    for ours, theirs in zip(numpy_engine.runner.kv_cache.arrays, graph_engine.runner.kv_cache.arrays, strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-5)


def test_overlapped_steps_through_numpy_equal_the_synchronous_graph():
    """Run ahead, the next step's token is a placeholder for the draw still on the device: the one-row
    step reads it first."""
    model = tiny_model(seed=4)
    numpy_engine, graph_engine = engine_of(model), engine_of(model)
    assert numpy_engine.run_ahead.is_enabled
    through_the_graph(graph_engine)
    graph_engine.run_ahead.is_enabled = False
    counts = row_steps_counted(numpy_engine)
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=30, logprobs=3)
    got = decode(numpy_engine, PROMPT, params)
    assert len(counts) == 29
    assert_same(got, decode(graph_engine, PROMPT, params))


def test_a_batch_of_several_rows_stays_in_the_graph():
    engine = engine_of(tiny_model(seed=5))
    counts = row_steps_counted(engine)
    for i in range(2):
        engine.add_request(PROMPT[i:], SamplingParams(temperature=0.0, max_tokens=6), request_id=str(i))
    while engine.has_unfinished_requests:
        engine.step()
    assert counts == []


@pytest.mark.parametrize("what", ["portable kernels", "int8 K/V", "8-bit weights", "an MoE block", "bfloat16"])
def test_a_model_it_does_not_run_keeps_the_graph(what, monkeypatch):
    config = {}
    overrides = {"an MoE block": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, decoder_sparse_step=1),
                 "int8 K/V": dict(head_dim=32)}.get(what, {})  # int8 groups of 32 along the head
    model = tiny_model(seed=6, **overrides)
    if what == "portable kernels":
        monkeypatch.setenv(kernels.PORTABLE_ENV, "1")
        kernels.choose()
    elif what == "int8 K/V":
        config["kv_cache_dtype"] = "int8"
    elif what == "8-bit weights":
        nn.quantize(model, group_size=32, bits=8)
    elif what == "bfloat16":
        model.set_dtype(mx.bfloat16)
    engine = engine_of(model, **config)
    assert not takes_rows(engine)
    assert isinstance(engine.runner.step_backend, CPURowStep) != (what == "portable kernels")  # built on the CPU's
