"""Tensor parallelism for the hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), 2 ranks against one: each
rank keeps half of every Gated DeltaNet layer's heads (its projections, conv channels and state) and half of
the experts' and the shared expert's FFN, and the engine gives the same tokens and logprobs through chunked
prefills, prefix hits from state checkpoints and preemption. The ranks are test_tensor_parallel.py's (one
group per test process)."""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_checkpoints import hf_checkpoint
from test_tensor_parallel import TP, load_engine
from tiny_models import run_outputs

from tinymlx import SamplingParams
from tinymlx.models import Recurrent
from tinymlx.models.sharding import AllReduceLinear

pytest.importorskip("torch")
pytest.importorskip("transformers")

HYBRIDS = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]
SETTINGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=24)


def workload() -> dict[int, list[tuple]]:
    """Ten requests over four steps, greedy and seeded sampling with logprobs; eight share a 40-token
    prefix, so later ones resume from its state checkpoints."""
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 256, 40).tolist()
    arrivals: dict[int, list[tuple]] = {}
    for i in range(10):
        prompt = (shared if i < 8 else []) + rng.integers(0, 256, int(rng.integers(2, 30))).tolist()
        params = SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=int(rng.integers(4, 16)),
                                ignore_eos=True, logprobs=2)
        arrivals.setdefault(0 if i < 2 else int(rng.integers(1, 4)), []).append((prompt, params, f"r{i}"))
    return arrivals


@pytest.mark.parametrize("variant", HYBRIDS)
def test_two_ranks_give_one_ranks_tokens_and_logprobs_through_prefix_hits_and_preemption(tmp_path, variant):
    model_dir = tmp_path / "m"
    hf_checkpoint(model_dir, variant)
    reference = run_outputs(load_engine(model_dir, num_pages=256, **SETTINGS), workload())
    # 44 blocks of 4 tokens: the ten requests (up to 85 tokens each) cannot all stay.
    engine = load_engine(model_dir, TP, num_pages=44, enable_prefix_caching=True, **SETTINGS)
    try:
        rank0, args = engine.runner.model, engine.runner.model.args
        recurrent = [spec for spec in rank0.layer_specs() if isinstance(spec, Recurrent)]
        assert recurrent and {(s.heads, s.conv_dim) for s in recurrent} == {(args.linear_num_value_heads // TP, (
            2 * args.linear_num_key_heads * args.linear_key_head_dim
            + args.linear_num_value_heads * args.linear_value_head_dim) // TP)}
        layer = next(layer for layer in rank0.model.layers if layer.is_linear)
        assert isinstance(layer.linear_attn.out_proj, AllReduceLinear)
        assert layer.linear_attn.dt_bias.shape == (args.linear_num_value_heads // TP,)
        if args.num_experts:  # one all-reduce for the routed and the shared experts together
            assert not isinstance(layer.mlp.shared_expert.down_proj, AllReduceLinear) and layer.mlp._all_reduce
        delta = engine.runner.state_pools[0].delta[layer.linear_attn.layer]
        assert delta.shape[1] == args.linear_num_value_heads // TP  # this rank's heads' states only

        collectives = engine.runner.ranks.collectives
        before = collectives.counts
        outputs = run_outputs(engine, workload())
        comm = collectives.counts - before
        assert {k: v.token_ids for k, v in outputs.items()} == {k: v.token_ids for k, v in reference.items()}
        for request_id, output in outputs.items():
            ours = np.array([[t.logprob, *(lp for _, lp in t.top)] for t in output.logprobs])
            theirs = np.array([[t.logprob, *(lp for _, lp in t.top)] for t in reference[request_id].logprobs])
            assert np.abs(ours - theirs).max() < 1e-4
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.state_slots.num_resumed > 0
        assert stats.state_slots.num_live_used == 0
        # Two all-reduces per layer and forward (after the mixer, attention or Gated DeltaNet, and after the
        # MLP), and two broadcasts per forward (its header and its inputs).
        assert comm.num_all_reduces == 2 * args.num_hidden_layers * comm.num_broadcasts // 2 > 0
    finally:
        engine.close()


def test_a_hybrid_whose_heads_do_not_split_fails_before_any_rank_starts(tmp_path):
    hf_checkpoint(tmp_path / "m", "qwen3_5_text", linear_num_key_heads=1, linear_num_value_heads=3)
    with pytest.raises(ValueError, match="1 linear-attention key heads.*3 linear-attention value heads"):
        load_engine(tmp_path / "m", TP, **SETTINGS)
