"""Hybrid recurrent models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) against transformers and against themselves:
the same logits as HF at prefill and every decode step; batched == sequential over chunked prefills;
prefix hits through state checkpoints, preemption and aborts changing no tokens, every step checked;
the two forms of the delta rule agreeing. Speculation and tensor parallelism on hybrids:
test_speculative_hybrid.py and test_tensor_parallel_hybrid.py."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hybrid_checkpoints import MOE, TEXT, VARIANTS, VISION, hf_checkpoint
from tiny_models import (
    ByteTokenizer,
    _flatten,
    dense_logits,
    hf_logits,
    max_diff,
    paged_logits,
    random_workload,
    run_outputs,
    run_to_completion,
)

from tinymlx import SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.core.errors import ModelLoadError
from tinymlx.engine.engine import Engine
from tinymlx.kv.recurrent_states import RecurrentStates
from tinymlx.kv.state_slots import ZERO_SLOT, StateSlots
from tinymlx.models import (
    FullAttention,
    Recurrent,
    args_from_config,
    gated_delta,
    load_model,
)
from tinymlx.models.registry import family_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5  # noqa: E402

# float32 through 4 layers of std-0.2 weights, logits up to ~7: HF and MLX round differently by up to
# ~1e-4 (qwen3_5_moe_text measured 1.03e-4 with mlx 0.32.4, torch 2.13); a wrong term moves them by >1e-2.
ATOL = 2e-4


def state_slots(engine: Engine) -> StateSlots:
    """The recurrent layers' slots (their manager's, among the engine's kinds of layer state)."""
    (states,) = [m for m in engine.kv_coordinator.managers if isinstance(m, RecurrentStates)]
    return states.slots


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers_at_prefill_and_every_decode_step(tmp_path, variant, kernel_path):
    hf_model = hf_checkpoint(tmp_path / "m", variant)
    model = load_model(tmp_path / "m", dtype="float32")
    spec = Recurrent(kernel=4, conv_dim=2 * 16 + 32, heads=4, key_dim=8, value_dim=8)
    assert model.layer_specs() == (spec, spec, spec, FullAttention())
    tokens = np.random.default_rng(1).integers(0, 300, 60).tolist()
    reference = hf_logits(hf_model, tokens)
    assert max_diff(dense_logits(model, tokens), reference) < ATOL
    # Chunks of 8 (two blocks of 4) then teacher-forced decodes; one 36-token chunk (the chunk-wise form
    # over 3 chunks of 16 with a padded tail) then decodes.
    for block_size, chunk_size in ((4, 8), (16, None)):
        paged = paged_logits(model, tokens, prompt_len=36, block_size=block_size, chunk_size=chunk_size, query_tile=8)
        assert len(paged) == len(tokens) - 36 + 1
        for step, logits in enumerate(paged):
            assert max_diff(logits, reference[35 + step]) < ATOL, (block_size, step)


def test_the_released_layout_loads_its_tower_and_no_mtp_weights(tmp_path):
    """qwen3_5 is the vision-language checkpoint: its tower loads (tests/test_qwen3_vl.py runs it); the MTP
    head is read only for speculative='mtp'."""
    hf_checkpoint(tmp_path / "m", "qwen3_5")
    names = [name for name, _ in _flatten(load_model(tmp_path / "m", dtype="float32").parameters())]
    assert any(name.startswith("visual.") for name in names) and not any("mtp" in name for name in names)


def test_mlx_lm_converted_checkpoints_load_as_they_are(tmp_path):
    """mlx-lm's conversion stores the 1 + w norms and conv1d as [C, K, 1]: the same model either way."""
    hf_checkpoint(tmp_path / "hf", "qwen3_5_text")
    converted = tmp_path / "mlx"
    converted.mkdir()
    (converted / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    weights = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", "_norm.weight")
    mx.save_safetensors(str(converted / "model.safetensors"), {
        name: value.moveaxis(2, 1) if name.endswith("conv1d.weight") else
        value + 1.0 if name.endswith(norms) and "linear_attn" not in name else value
        for name, value in weights.items()})
    tokens = np.random.default_rng(3).integers(0, 300, 30).tolist()
    ours, theirs = (dense_logits(load_model(path, dtype="float32"), tokens) for path in (tmp_path / "hf", converted))
    assert max_diff(ours, theirs) < 1e-6


def _model(tmp_path: Path, variant: str = "qwen3_5_text"):
    hf_checkpoint(tmp_path / "m", variant)
    return load_model(tmp_path / "m", dtype="float32")


def _engine(model, **config) -> Engine:
    settings = dict(block_size=4, num_pages=256, max_num_batched_tokens=24, enable_prefix_caching=False)
    return Engine(model, ByteTokenizer(), EngineConfig(**{**settings, **config}))


@pytest.mark.parametrize("variant", ["qwen3_5_text", "qwen3_next"])
def test_batched_equals_sequential_over_chunked_prefills(tmp_path, variant):
    """Six requests of mixed lengths, many of whose prompts cross several 24-token chunks, while others decode."""
    model = _model(tmp_path, variant)
    arrivals = random_workload(6, seed=3, max_arrival=2)
    requests = [item for step in sorted(arrivals) for item in arrivals[step]]
    assert sum(len(prompt) > 24 for prompt, _, _ in requests) >= 3
    batched = run_to_completion(_engine(model), {0: requests})
    for request in requests:
        assert run_to_completion(_engine(model), {0: [request]}) == {request[2]: batched[request[2]]}


def test_prefix_hits_resume_from_state_checkpoints(tmp_path):
    """Requests sharing a 72-token prefix: the later ones resume from the checkpoint at its last full block
    (72 tokens in, where the first request's prompt has its last full block) and decode as an uncached engine does."""
    model = _model(tmp_path)
    rng = np.random.default_rng(4)
    shared = rng.integers(0, 256, 72).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [(shared + rng.integers(0, 256, 2 + i % 2).tolist(), params, f"r{i}") for i in range(4)]
    reference = run_to_completion(_engine(model), {0: requests})
    cached = _engine(model, enable_prefix_caching=True, max_num_batched_tokens=32)
    outputs = run_outputs(cached, {0: requests[:1], 4: requests[1:]})
    assert {request_id: out.token_ids for request_id, out in outputs.items()} == reference
    assert [outputs[f"r{i}"].metrics.num_cached_tokens for i in range(4)] == [0, 72, 72, 72]
    states = cached.stats().state_slots
    assert (states.num_resumed, states.num_resumed_tokens) == (3, 3 * 72)
    # The first prompt's chunks end at 32 and 64, and its last full block at 72: a checkpoint at each; and
    # each reply (computed up to token 85 or 86) leaves one at each block end it reaches: 76, 80, 84.
    assert states.num_checkpoints_cached == 3 + 4 * 3 and states.num_live_used == 0


def test_without_a_checkpoint_a_hit_stops_at_the_deepest_one(tmp_path):
    """KV blocks for the whole shared prefix are cached, but with checkpoints only at chunk ends of 32 the
    hit resumes at the deepest checkpoint below the divergence, and still decodes as an uncached engine."""
    model = _model(tmp_path)
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 256, 50).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [(shared + rng.integers(0, 256, 30).tolist(), params, f"r{i}") for i in range(2)]
    reference = run_to_completion(_engine(model), {0: requests})
    cached = _engine(model, enable_prefix_caching=True, max_num_batched_tokens=32)
    outputs = run_outputs(cached, {0: requests[:1], 8: requests[1:]})
    assert {request_id: out.token_ids for request_id, out in outputs.items()} == reference
    # r0's checkpoints: 32, 64 (chunk ends), 80 (its last full block); r1 shares 48 tokens' blocks: resumes at 32.
    assert outputs["r1"].metrics.num_cached_tokens == 32


def test_preemption_and_aborts_change_no_tokens(tmp_path):
    """In a pool small enough to preempt (recompute from the last checkpoint), with one request aborted
    mid-prefill and one mid-decode, the others' tokens are those of a roomy engine; every step checked."""
    model = _model(tmp_path)
    rng = np.random.default_rng(6)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [(rng.integers(0, 256, 30 + 7 * i).tolist(), params, f"r{i}") for i in range(4)]
    reference = run_to_completion(_engine(model), {0: requests})
    for caching in (False, True):
        small = _engine(model, num_pages=28, enable_prefix_caching=caching)
        small.add_request(rng.integers(0, 256, 90).tolist(), params, request_id="mid-prefill")
        small.add_request(requests[0][0], params, request_id="mid-decode")
        for _ in range(2):
            small.step()
            small.check()
        assert 0 < small.requests.get("mid-prefill").seq.num_computed_tokens < 90
        small.abort("mid-prefill")
        small.check()
        while not small.requests.get("mid-decode").seq.num_output_tokens:
            small.step()
            small.check()
        small.abort("mid-decode")
        small.check()
        finals = run_to_completion(small, {0: requests})
        assert {k: v for k, v in finals.items() if k.startswith("r")} == reference
        assert small.scheduler.num_preemptions > 0
        assert small.stats().state_slots.num_live_used == 0


def test_chunks_of_a_hybrid_sequence_end_on_block_ends(tmp_path):
    model = _model(tmp_path)
    engine = _engine(model, max_num_batched_tokens=10)  # 10 tokens: chunks of 8 (two blocks of 4)
    engine.add_request(list(range(30)), SamplingParams(max_tokens=2, ignore_eos=True))
    starts = []
    while engine.has_unfinished_requests:
        batch = engine.scheduler.schedule()
        starts += [(c.start_position, len(c.token_ids)) for c in batch.chunks]
        logits = engine.runner.run(batch)
        mx.eval(logits)
        engine.scheduler.commit(batch, {c.seq_id: [1] for c in batch.sampled_chunks}, {})
        if len(starts) > 6:
            break
    assert starts[:5] == [(0, 8), (8, 8), (16, 8), (24, 6), (30, 1)]


def test_checkpoints_are_published_at_commit_not_at_schedule(tmp_path):
    model = _model(tmp_path)
    engine = _engine(model, enable_prefix_caching=True, max_num_batched_tokens=16)
    engine.add_request(list(range(40)), SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    states = state_slots(engine)
    (chunk,) = batch.chunks
    assert chunk.state.checkpoints and states.num_cached_checkpoints == 0  # reserved, not visible
    engine.scheduler.commit(batch, {}, {})
    assert states.num_cached_checkpoints == 1
    engine.check()


@pytest.mark.parametrize(("dtype", "tolerance"), [("q8", 0.1), ("q4", 0.6)])
def test_quantized_load_and_run(tmp_path, dtype, tolerance):
    """Quantization errors add up along the recurrence (and flip an expert here and there): the mean error
    is bounded, relative to the logits' size (q8 measured 6%, q4 48%; a wrong weight gives 100% and more)."""
    hf_checkpoint(tmp_path / "m", "qwen3_next", std=0.05, hidden_size=128, intermediate_size=256,
                  moe_intermediate_size=64, shared_expert_intermediate_size=64, linear_value_head_dim=16)
    tokens = np.random.default_rng(0).integers(0, 300, 40).tolist()
    reference = dense_logits(load_model(tmp_path / "m", dtype="float32"), tokens)
    quantized = load_model(tmp_path / "m", dtype=dtype)
    assert "scales" in quantized.model.layers[0].linear_attn.in_proj_qkv
    error = np.abs(np.array(dense_logits(quantized, tokens)) - np.array(reference)).mean()
    assert error < tolerance * np.abs(np.array(reference)).mean()


def test_the_pool_counts_the_state_slots(tmp_path):
    """The zero and live slots come out of the budget first; checkpoints are pages of the KV pool, held as
    they are kept: the state arrays and the KV arrays together stay within the budget."""
    model = _model(tmp_path)
    budget = 4 << 20
    engine = _engine(model, num_pages=None, kv_cache_bytes=budget, max_num_seqs=4, num_state_checkpoints=6,
                     enable_prefix_caching=True)
    stats = engine.stats()
    assert stats.state_slots.num_live_slots == 4 and stats.state_slots.num_checkpoint_slots == 6
    per_slot = 3 * 4 * (3 * 64 + 4 * 8 * 8)  # three recurrent layers' float32 conv and delta-rule states
    assert stats.state_slots.slot_nbytes == per_slot
    assert stats.state_slots.nbytes == (1 + 4 + 4) * per_slot  # the region's first slots: one per sequence
    assert stats.pools_bytes_budget <= budget
    prompts = {name: list(range(start, start + 30)) for name, start in (("a", 1), ("b", 101))}
    run_to_completion(engine, {0: [(prompt, SamplingParams(max_tokens=4), name) for name, prompt in prompts.items()]})
    stats = engine.stats()
    region = stats.state_slots.nbytes // per_slot - (1 + 4)
    assert 0 < stats.state_slots.num_checkpoints_cached <= region and 4 <= region <= 6
    pool = engine.kv_coordinator.pool
    assert pool.boundary == engine.config.num_pages - region * engine.config.state_slot_pages
    assert engine.runner.kv_cache.num_allocated_pages <= pool.boundary
    assert stats.kv_cache_bytes + stats.state_slots.nbytes <= budget
    with pytest.raises(ValueError, match="cannot hold the recurrent state slots"):
        _engine(model, num_pages=None, kv_cache_bytes=per_slot * 4, max_num_seqs=4)
    with pytest.raises(ValueError, match="end on block ends"):  # a chunk could never end: refused, not stuck
        _engine(model, block_size=16, max_num_batched_tokens=8)


def test_the_page_counts_add_up_with_the_checkpoints_pages(tmp_path):
    """Used, cached, free and the checkpoints' pages make the pool, before requests and after; what a new
    sequence may take (stats().num_pages_available) is what the coordinator can hand out, the region's
    unpinned checkpoints included once their sequences are done."""
    engine = _engine(_model(tmp_path), num_pages=None, kv_cache_bytes=4 << 20, max_num_seqs=4,
                     num_state_checkpoints=6, enable_prefix_caching=True)
    slot_pages = engine.config.state_slot_pages

    def counts():
        stats = engine.stats()
        assert (stats.num_pages_used + stats.num_pages_cached + stats.num_pages_free + stats.num_pages_states
                == stats.num_pages_total)
        assert stats.num_pages_available == engine.kv_coordinator.num_available_pages
        return stats

    before = counts()
    assert before.num_pages_states == 4 * slot_pages and before.num_pages_releasable == 4 * slot_pages  # all empty
    assert before.num_pages_used == before.num_pages_cached == 0
    prompts = {name: list(range(start, start + 30)) for name, start in (("a", 1), ("b", 101))}
    run_to_completion(engine, {0: [(prompt, SamplingParams(max_tokens=4), name) for name, prompt in prompts.items()]})
    after = counts()
    assert after.state_slots.num_checkpoints_cached > 0 and after.num_pages_cached > 0
    assert after.num_pages_states >= before.num_pages_states
    assert after.num_pages_releasable == after.num_pages_states  # nothing pinned once every sequence is done


# -- the delta rule's two forms, and the slot accounting, on their own ---------------------------------
def _delta_inputs(rng, B=3, L=37, H=4, Dk=8, Dv=6):
    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, k = normal(B, L, H, Dk), normal(B, L, H, Dk)
    q, k = (x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6) for x in (q, k))
    return (q * Dk**-0.5, k, normal(B, L, H, Dv), -np.abs(normal(B, L, H)) * 2,
            1 / (1 + np.exp(-normal(B, L, H))), normal(B, H, Dk, Dv) * 0.3)


def test_the_chunk_wise_and_token_by_token_delta_rules_agree():
    q, k, v, g, beta, state = (mx.array(x) for x in _delta_inputs(np.random.default_rng(0)))
    lengths = mx.array([37, 20, 5])
    g, beta = gated_delta.mask_padding(g, beta, lengths)  # padded rows leave their state as it is
    out, final, kept = gated_delta.recurrent(q, k, v, g, beta, state, keep=[(1, 16), (0, 3), (1, 3)])
    after_16 = gated_delta.recurrent(q[1:2, :16], k[1:2, :16], v[1:2, :16], g[1:2, :16], beta[1:2, :16], state[1:2])[1]
    after_3 = gated_delta.recurrent(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], state)[1]
    # The token-by-token form keeps a row's state after any token (a verified chunk's every position).
    assert max_diff(kept[0], after_16) < 1e-6 and max_diff(kept[1], after_3[:1]) < 1e-6
    assert max_diff(kept[2], after_3[1:2]) < 1e-6 and max_diff(kept[1], kept[2]) > 1e-3
    for chunk in (4, 16, 64):
        keep = [(1, 16), (0, 32)] if chunk <= 16 else []
        chunked, chunked_final, kept = gated_delta.chunked(q, k, v, g, beta, state, chunk, keep=keep)
        assert max_diff(chunked, out) < 1e-5 and max_diff(chunked_final, final) < 1e-5
        if keep:
            assert max_diff(kept[0], after_16) < 1e-5 and max_diff(kept[1][0], chunked_final[0]) > 1e-3
    # Row 1 stops at 20 tokens: its final state is that of its real tokens.
    _, short, _ = gated_delta.recurrent(q[1:2, :20], k[1:2, :20], v[1:2, :20], g[1:2, :20], beta[1:2, :20], state[1:2])
    assert max_diff(final[1], short[0]) < 1e-6


def test_the_delta_rule_equals_transformers_reference():
    q, k, v, g, beta, state = _delta_inputs(np.random.default_rng(1), B=2, L=30)
    T = torch.from_numpy
    # transformers normalises q and k itself and scales q: hand it the unscaled q (already unit-norm).
    ref, ref_state = hf_qwen3_5.torch_recurrent_gated_delta_rule(
        T(q * 8**0.5), T(k), T(v), T(g), T(beta), initial_state=T(state), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    out, final, _ = gated_delta.chunked(*(mx.array(x) for x in (q, k, v, g, beta, state)), chunk_size=16)
    assert max_diff(out, ref.numpy()) < 1e-5 and max_diff(final, ref_state.numpy()) < 1e-5


def test_causal_conv_carries_its_inputs_across_calls():
    rng = np.random.default_rng(2)
    x, weight = mx.array(rng.standard_normal((1, 11, 5)).astype(np.float32)), mx.array(rng.standard_normal((5, 4)).astype(np.float32))
    whole, _ = gated_delta.causal_conv(x, mx.zeros((1, 3, 5)), weight)
    first, inputs = gated_delta.causal_conv(x[:, :6], mx.zeros((1, 3, 5)), weight)
    second, _ = gated_delta.causal_conv(x[:, 6:], inputs[:, 6:9], weight)
    assert max_diff(mx.concatenate([first, second], axis=1), whole) < 1e-6


def test_state_slots_pin_resumed_checkpoints_and_evict_the_least_recently_used():
    slots = StateSlots(num_live=2, num_checkpoints=2)
    a, b, c = 0, 1, 2  # sequence ids
    slots.admit(a, None, 0)
    assert slots.slots(a)[0] == ZERO_SLOT
    first, second = slots.reserve(a, 11), slots.reserve(a, 12)
    assert slots.reserve(a, 11) is None  # one checkpoint per block hash
    assert not slots.has_checkpoint(11)
    slots.commit(a)
    assert slots.has_checkpoint(11) and slots.has_checkpoint(12)
    slots.admit(b, 11, 16)  # b resumes from 11: pinned, and now the most recently used
    assert slots.slots(b)[0] == first
    slots.check([a, b])
    assert slots.reserve(a, 13) == second  # no slot free: the least recently used, 12, gives its slot up
    slots.commit(a)
    assert slots.reserve(a, 14) == second and slots.has_checkpoint(11)  # 13 goes: 11 is pinned
    slots.commit(a)
    assert not slots.has_checkpoint(13)
    slots.free(a)
    slots.commit(b)  # b's first chunk ran: it reads its own slot from now on, 11 is unpinned
    slots.admit(c, None, 0)
    slots.check([b, c])
    slots.free(b)
    slots.free(c)
    slots.check([])
    with pytest.raises(AssertionError, match="leaked"):
        slots.admit(a, None, 0)
        slots.check([])


def test_an_unknown_layer_type_is_refused_naming_it():
    config = {**TEXT, "model_type": "qwen3_5_text", "layer_types": ["linear_attention", "mamba", "linear_attention",
                                                                     "full_attention"]}
    with pytest.raises(ModelLoadError, match=r"layer types \['mamba'\] are not supported by qwen3_5_text"):
        args_from_config(config)


def test_a_next_turn_resumes_inside_the_last_reply(tmp_path):
    """A decode leaves a state checkpoint at each block end of the reply: the next turn (the prompt, the
    reply, a new message) resumes at the reply's last block end, not at the prompt's, with the same tokens."""
    model = _model(tmp_path)
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, 256, 30).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = _engine(model, enable_prefix_caching=True, max_num_batched_tokens=32)
    reply = run_to_completion(engine, {0: [(prompt, params, "turn 1")]})["turn 1"]
    turn = (prompt + reply + rng.integers(0, 256, 10).tolist(), params, "turn 2")
    outputs = run_outputs(engine, {0: [turn]})
    # Turn 1 computed its prompt and all but its last reply token: 69 tokens, the last block end at 68.
    assert outputs["turn 2"].metrics.num_cached_tokens == 68
    assert outputs["turn 2"].token_ids == run_to_completion(_engine(model), {0: [turn]})["turn 2"]


@pytest.mark.parametrize(("model_type", "text_type"), [("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text")])
def test_a_vision_config_without_a_tower_is_its_text_model(model_type, text_type):
    """mlx-lm's text conversions keep model_type qwen3_5 and drop vision_config: the text model, whole. With a
    vision_config the tower is built too."""
    text = {**TEXT, **(MOE if "moe" in model_type else {}), "model_type": text_type}
    towerless = args_from_config({"model_type": model_type, "text_config": text})
    assert towerless.model_type == text_type and not family_for(towerless.model_type).model.sees_images
    seeing = args_from_config({"model_type": model_type, "text_config": text, "vision_config": VISION})
    assert seeing.model_type == model_type and family_for(seeing.model_type).model.sees_images


def test_a_checkpoint_evicted_while_its_sequence_is_admitted_ends_the_hit_there(tmp_path):
    """In a pool full of cached blocks, admitting a sequence can evict the checkpoint its hit was to resume from
    (checkpoints are pages of the pool): the hit ends shallower, with no lower tier to ask (this raised an
    AttributeError), and every token is an uncached engine's."""
    model = _model(tmp_path)
    shared = [7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    arrivals = {step: [(shared + prompt, params, request_id) for prompt, params, request_id in items]
                for step, items in random_workload(12, seed=2, max_arrival=3, seeded_sampling=True).items()}
    reference = run_to_completion(_engine(model), {step: list(items) for step, items in arrivals.items()})
    cached = _engine(model, enable_prefix_caching=True, num_pages=100)
    assert run_to_completion(cached, arrivals) == reference
