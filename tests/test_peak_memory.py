"""The budget holds: for each workload, MLX's peak memory while the engine loads and runs stays at most the
weights plus the memory budget (`stats().memory_budget_bytes`: every pool and the largest step's activations)
plus FRAMEWORK_BYTES. Workloads: a hybrid with MTP speculation, a draft pair, Gemma 4 with KV-shared layers,
a 16k prompt in chunks (where the activations' allowance decides the chunks), 16 concurrent chats."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
from hybrid_checkpoints import hf_checkpoint
from test_memory_budget import run_checked, workload
from test_mtp import add_mtp_weights
from tiny_models import ByteTokenizer, tiny_model

from tinymlx import Engine, EngineConfig, SamplingParams
from tinymlx.models import load_model, load_mtp_head

MiB = 1 << 20
# What MLX may hold beyond the weights, the pools and the activations' allowance: a pool place's old and new
# arrays side by side while the pool grows (kv_cache.py `_resize`), a tiny model's initial weights before
# random ones replace them, the sampler's and the step inputs' small arrays. Measured on these workloads (both
# kernel paths, mlx 0.32.4's CPU backend, 2-core EPYC): every peak stayed 2.0 MiB or more below weights +
# budget, the transients inside what the allowance leaves unused; 1 MiB is kept for the allocator's rounding.
FRAMEWORK_BYTES = 1 * MiB


def peak_within_budget(build: Callable[[], Engine], arrivals: dict[int, list[tuple]]) -> tuple[int, int]:
    """(MLX's peak from before the engine's models were built to the workload's end, what the budget allows:
    the weights, every pool and the activations' allowance, plus FRAMEWORK_BYTES)."""
    gc.collect()  # earlier tests' garbage must not be freed, nor counted, while this one measures
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    engine = build()
    run_checked(engine, arrivals)
    mx.synchronize()
    peak, stats = mx.get_peak_memory() - before, engine.stats()
    engine.close()
    return peak, stats.weights_bytes + stats.draft_weights_bytes + stats.memory_budget_bytes + FRAMEWORK_BYTES


def test_a_hybrid_with_mtp_speculation(tmp_path):
    pytest.importorskip("transformers")
    hf_checkpoint(tmp_path / "m", "qwen3_5_text")
    add_mtp_weights(tmp_path / "m", "hf")

    def build() -> Engine:
        target = load_model(tmp_path / "m", dtype="float32")
        head = load_mtp_head(tmp_path / "m", target)
        config = EngineConfig(memory_budget_bytes=4 * MiB, block_size=4, speculative="mtp", max_num_batched_tokens=32)
        return Engine(target, ByteTokenizer(), config, draft_model=head)

    peak, bound = peak_within_budget(build, workload(seed=1))
    assert peak <= bound


def test_a_draft_pair():
    def build() -> Engine:
        config = EngineConfig(memory_budget_bytes=4 * MiB, block_size=4, speculative="draft:other,adaptive=0")
        return Engine(tiny_model(0, hidden_size=256, intermediate_size=512), ByteTokenizer(), config,
                      draft_model=tiny_model(5, hidden_size=256, intermediate_size=512))

    peak, bound = peak_within_budget(build, workload())
    assert peak <= bound


def test_gemma4_with_kv_shared_layers(tmp_path):
    pytest.importorskip("transformers")
    from test_gemma4 import RICH
    from test_gemma4 import hf_checkpoint as gemma4_checkpoint

    gemma4_checkpoint(tmp_path / "m", RICH)

    def build() -> Engine:
        config = EngineConfig(memory_budget_bytes=4 * MiB, block_size=4)
        return Engine(load_model(tmp_path / "m", dtype="float32"), ByteTokenizer(), config)

    peak, bound = peak_within_budget(build, workload(seed=3))
    assert peak <= bound


def long_prompt_engine_with(**config) -> Engine:
    return Engine(tiny_model(0, std=0.05, max_position_embeddings=16_640), ByteTokenizer(),
                  EngineConfig(block_size=16, **config))


def long_prompt_engine(shrink_chunks: bool = True) -> Engine:
    """A tiny model with a 16k+ context under a 32 MiB budget: a full 512-token chunk at 16k would take about
    270 MiB of attention scores, so the allowance (about 15 MiB) decides how long its chunks may be."""
    engine = long_prompt_engine_with(memory_budget_bytes=32 * MiB)
    if not shrink_chunks:  # the allowance turned off: every chunk as long as max_num_batched_tokens allows
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, step_shape=None)
    return engine


def long_prompt() -> dict[int, list[tuple]]:
    prompt = np.random.default_rng(0).integers(0, 256, 16_384).tolist()
    return {0: [(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "long")]}


@pytest.mark.kernel_paths("portable", "cpu")
def test_a_16k_prompt_in_chunks(kernel_path):
    peak, bound = peak_within_budget(long_prompt_engine, long_prompt())
    assert peak <= bound


@pytest.mark.kernel_paths("cpu")
def test_the_16k_prompt_passes_the_budget_when_chunks_keep_their_length(kernel_path):
    """The test above can fail: without the scheduler's chunk sizing the same workload's peak is far past it."""
    peak, bound = peak_within_budget(lambda: long_prompt_engine(shrink_chunks=False), long_prompt())
    assert peak > 4 * bound


def test_16_concurrent_chats():
    rng = np.random.default_rng(4)
    chats = [(rng.integers(0, 256, int(rng.integers(64, 200))).tolist(),
              SamplingParams(temperature=0.8, seed=i, max_tokens=32, ignore_eos=True), f"chat{i}") for i in range(16)]

    def build() -> Engine:
        config = EngineConfig(memory_budget_bytes=8 * MiB, block_size=16, max_num_seqs=16)
        return Engine(tiny_model(0, hidden_size=128, intermediate_size=256), ByteTokenizer(), config)

    peak, bound = peak_within_budget(build, {0: chats})
    assert peak <= bound


def test_a_budget_too_small_for_one_request_is_refused_up_front():
    """A block of every kind and the smallest step's activations (a block of tokens attending the longest
    context) must fit, or no request could ever finish: refused when the engine is made."""
    with pytest.raises(ValueError, match="cannot hold the activations of the smallest step"):
        long_prompt_engine_with(memory_budget_bytes=4 * MiB)
