"""kv_cache_dtype="int8": the pool's bytes, attention's accuracy against the full-precision pool, and
every engine path (batching, preemption, prefix hits, speculation) unchanged by storing K/V as int8."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import (
    ByteTokenizer,
    dense_logits,
    paged_logits,
    random_workload,
    run_to_completion,
    tiny_model,
)

from tinymlx import Engine, EngineConfig, SamplingParams
from tinymlx.core.kv_layout import KVLayout

HEAD_DIM = 32  # int8 groups are at least 32 values wide (mx.quantize's smallest group)
MODEL = tiny_model(seed=3, head_dim=HEAD_DIM)


def engine(kv_cache_dtype: str = "int8", model=MODEL, **config) -> Engine:
    config = {"block_size": 4, "num_pages": 256, **config}
    return Engine(model, ByteTokenizer(), EngineConfig(kv_cache_dtype=kv_cache_dtype, **config))


@pytest.mark.parametrize(("dtype", "fraction"), [
    (mx.float32, (32 + 2 * 4) / (32 * 4)),  # codes + a float32 scale and bias, against 4 bytes a value
    (mx.bfloat16, (32 + 2 * 2) / (32 * 2)),
])
def test_int8_blocks_take_the_expected_fraction_of_the_pool(dtype, fraction):
    model = tiny_model(seed=3, head_dim=HEAD_DIM)
    model.set_dtype(dtype)
    full, int8 = engine("auto", model, num_pages=10), engine("int8", model, num_pages=10)
    assert int8.runner.kv_cache.nbytes == pytest.approx(fraction * full.runner.kv_cache.nbytes)
    assert {a.dtype for a in int8.runner.kv_cache.pools[0]} == {mx.uint32, dtype}
    assert int8.stats().kv_cache_bytes == int8.runner.kv_cache.nbytes
    # A byte budget holds the inverse fraction more blocks.
    budget = full.runner.kv_cache.nbytes * 40
    blocks = {d: EngineConfig(kv_cache_bytes=budget, kv_cache_dtype=d).resolve(model.args, dtype).num_pages
              for d in ("auto", "int8")}
    assert blocks["int8"] == pytest.approx(blocks["auto"] / fraction, rel=0.02)


FAMILIES = {  # every kind of layer state: full attention, sliding windows, recurrent layers beside attention
    "qwen2": {},
    "gemma3_text": dict(model_type="gemma3_text", sliding_window=12, sliding_window_pattern=2, num_hidden_layers=4),
    "qwen3_5_text": dict(model_type="qwen3_5_text", num_hidden_layers=4, linear_conv_kernel_dim=4,
                         linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                         linear_num_value_heads=4),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_int8_logits_stay_within_tolerance_of_the_full_precision_pool(family, kernel_path):
    """Prefill tiles (dequantized context on the CPU) and decodes (quantized_matmul on the codes), over a
    scattered block table: the int8 pool's logits are within 0.5% of the logit range of the dense reference,
    and really differ from the float pool's (the codes are used)."""
    model = MODEL if family == "qwen2" else tiny_model(seed=3, std=0.1, head_dim=HEAD_DIM, **FAMILIES[family])
    tokens = np.random.default_rng(0).integers(0, 256, 90).tolist()
    reference = np.array(dense_logits(model, tokens))[59:]
    results = {}
    for kv_cache_dtype in ("auto", "int8"):
        logits = paged_logits(model, tokens, prompt_len=60, block_size=8, chunk_size=40, query_tile=16,
                              kv_cache_dtype=kv_cache_dtype)
        results[kv_cache_dtype] = np.abs(np.stack([np.array(x) for x in logits]) - reference).max()
    spread = reference.max() - reference.min()
    assert results["auto"] < 1e-4 * spread
    assert 1e-5 * spread < results["int8"] < 0.005 * spread, (results, spread)


def test_int8_layout_needs_a_head_dim_it_can_group():
    with pytest.raises(ValueError, match="multiple of 32"):
        KVLayout(16, mx.float32, "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="cannot use it"):
        EngineConfig(num_pages=8, kv_cache_dtype="int8").resolve(tiny_model(seed=0).args, mx.float32)


def test_int8_batched_preempted_and_prefix_hits_equal_one_at_a_time():
    """Storing K/V as int8 is deterministic per token: batching, recompute after preemption and K/V
    reused from the prefix cache give exactly the tokens of each request run alone."""
    shared = list(b"a shared system prompt, three blocks long")
    arrivals = random_workload(16, seed=4, max_arrival=3, seeded_sampling=True)
    for items in arrivals.values():
        for i, (prompt, params, request_id) in enumerate(items):
            items[i] = (shared + prompt, params, request_id)
    alone = {}
    for items in arrivals.values():
        for item in items:
            alone.update(run_to_completion(engine(enable_prefix_caching=False), {0: [item]}))
    tight = engine(num_pages=40, max_num_batched_tokens=64)
    assert run_to_completion(tight, {k: list(v) for k, v in arrivals.items()}) == alone
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_rate > 0.3


@pytest.mark.parametrize("speculative", ["ngram", "draft:self,adaptive=0"])
def test_int8_speculation_is_lossless(speculative):
    """Rejected drafts' int8 K/V are rolled back like any other: outputs equal plain decoding's."""
    arrivals = random_workload(10, seed=5, seeded_sampling=True)
    repeat = list(b"abcabcabcabcabcabc")  # something n-gram can copy
    for items in arrivals.values():
        for i, (prompt, params, request_id) in enumerate(items):
            items[i] = (repeat + prompt, params, request_id)
    plain = run_to_completion(engine(), {k: list(v) for k, v in arrivals.items()})
    draft = MODEL if speculative.startswith("draft:") else None
    drafted = Engine(MODEL, ByteTokenizer(), EngineConfig(block_size=4, num_pages=256, kv_cache_dtype="int8",
                                                          speculative=speculative), draft_model=draft)
    assert run_to_completion(drafted, arrivals) == plain
    assert drafted.stats().num_accepted_tokens > 0


def test_int8_pool_generates_like_the_full_precision_pool():
    """Greedy on a smooth tiny model (small weights): int8 K/V change no token of these prompts."""
    smooth = tiny_model(seed=1, std=0.08, head_dim=HEAD_DIM)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = {f"p{i}": list(f"prompt number {i}: the quick brown fox".encode()) for i in range(4)}
    outputs = {}
    for kv_cache_dtype in ("auto", "int8"):
        outputs[kv_cache_dtype] = run_to_completion(
            engine(kv_cache_dtype, smooth), {0: [(p, params, r) for r, p in prompts.items()]})
    assert outputs["int8"] == outputs["auto"]
