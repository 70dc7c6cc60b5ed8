"""Gemma 4 (text) against transformers, in float32: sliding (window 8) and global layers with their own head_dim
and proportional RoPE; and a second checkpoint with KV-shared layers, per-layer inputs, the MoE block, k_eq_v
(global layers with fewer KV heads) and the double-wide MLP. Logits at prefill and at every teacher-forced
decode step through the paged cache (prompts several windows long) on both kernel paths; then the engine:
batched == sequential, prefix hits == uncached (deeper than the window), preemption in a small pool, TP=2 ==
TP=1, q8/q4; the shared layers hold no blocks, and one reading the wrong layer fails parity."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from tiny_models import (
    ByteTokenizer,
    dense_logits,
    hf_logits,
    max_diff,
    paged_logits,
    random_workload,
    run_outputs,
    run_to_completion,
)

from tinymlx import EngineConfig, SamplingParams
from tinymlx.core.errors import ModelLoadError
from tinymlx.core.layer_specs import FullAttention, SharedKV, SlidingWindow, block_costs, kv_groups
from tinymlx.engine.engine import Engine
from tinymlx.models import load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SLIDING, FULL = "sliding_attention", "full_attention"
PLAIN = dict(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8, max_position_embeddings=512,
             layer_types=[SLIDING, SLIDING, FULL] * 2, hidden_size_per_layer_input=0, final_logit_softcapping=30.0)
# The E2B/E4B structure (KV sharing, per-layer inputs, double-wide MLPs) and the 26B's (MoE, k_eq_v) at once.
RICH = dict(PLAIN, num_kv_shared_layers=3, hidden_size_per_layer_input=8, vocab_size_per_layer_input=300,
            use_double_wide_mlp=True, enable_moe_block=True, num_experts=4, top_k_experts=2,
            moe_intermediate_size=64, num_key_value_heads=4, attention_k_eq_v=True, num_global_key_value_heads=2)
ATOL = 1e-4


def hf_checkpoint(path: Path, config: dict, seed: int = 0, std: float = 0.2, qk_norm: float = 1.0):
    config = transformers.Gemma4TextConfig(**config)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():  # beyond HF's init, so every term matters
            param.normal_(0, 1.0 if name.endswith("router.proj.weight") else std)  # a router clear of ties
            if "norm" in name or "scale" in name:
                param.add_(qk_norm if "q_norm" in name or "k_norm" in name else 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["plain", "rich"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gemma4_{request.param}") / "m"
    config = PLAIN if request.param == "plain" else RICH
    return hf_checkpoint(path, config), path, config


def test_logits_equal_transformers_at_prefill_and_every_decode_step(checkpoint, kernel_path):
    hf_model, path, config = checkpoint
    model = load_model(path, dtype="float32")
    window = SlidingWindow(8, config["num_key_value_heads"], 16)
    full = FullAttention(config.get("num_global_key_value_heads", 2), 32)  # 4 x 16 and 2 x 32: pieces of 2 x 16
    expected = (window, window, full) * 2 if config is PLAIN else (window, window, full, SharedKV(1), SharedKV(1),
                                                                     SharedKV(2))
    assert model.layer_specs() == expected
    tokens = np.random.default_rng(1).integers(0, 300, 50).tolist()
    reference = hf_logits(hf_model, tokens)
    assert max_diff(dense_logits(model, tokens), reference) < ATOL
    for block_size, chunk_size in ((4, 8), (16, None)):  # prompts of 30 tokens: nearly four windows
        paged = paged_logits(model, tokens, prompt_len=30, block_size=block_size, chunk_size=chunk_size, query_tile=8)
        assert len(paged) == len(tokens) - 30 + 1
        for step, logits in enumerate(paged):
            assert max_diff(logits, reference[29 + step]) < ATOL, (block_size, step)


def test_pieces_of_differing_shapes_page_without_padding():
    """E2B's shapes: 12 sliding layers (1 x 256) and 3 global (1 x 512) -> pieces of 1 x 256, a page 6 of
    them; a global block is one page, a sliding block two: exactly the bytes each holds."""
    specs = (SlidingWindow(512, 1, 256),) * 4 + (FullAttention(1, 512),)
    groups = kv_groups(specs * 3)
    assert block_costs(groups) == (2, 1)
    rich = kv_groups((SlidingWindow(8, 4, 16), FullAttention(2, 32)))  # heads split one way, widths the other
    assert block_costs(rich) == (1, 1)


def test_shared_layers_hold_no_blocks_and_reading_the_wrong_layer_fails(tmp_path_factory, monkeypatch):
    path = tmp_path_factory.mktemp("gemma4_shared") / "m"
    hf_model = hf_checkpoint(path, RICH)
    model = load_model(path, dtype="float32")
    engine = Engine(model, ByteTokenizer(), EngineConfig(block_size=4, num_pages=64))
    run_to_completion(engine, random_workload(2, seed=1, max_arrival=1))
    groups = engine.stats().kv_groups
    assert [(g.window, g.num_layers, g.num_shared_layers) for g in groups] == [(8, 2, 2), (None, 1, 1)]
    assert sum(g.num_layers for g in groups) == 3  # of 6 layers: the shared ones hold nothing
    assert len(engine.runner.kv_cache.pools) == 2  # a page: 2 pieces (a sliding layer, or a global one)

    tokens = np.random.default_rng(2).integers(0, 300, 30).tolist()
    reference = hf_logits(hf_model, tokens)
    assert max_diff(paged_logits(model, tokens, 20, 4)[0], reference[19]) < ATOL
    wrong = (*model.layer_specs()[:3], SharedKV(0), SharedKV(1), SharedKV(2))  # layer 3 reads layer 0's K/V
    monkeypatch.setattr(model, "layer_specs", lambda: wrong)
    assert max_diff(paged_logits(model, tokens, 20, 4)[0], reference[19]) > 1e-2


def sequential_outputs(model, arrivals: dict[int, list[tuple]]) -> dict[str, list[int]]:
    outputs = {}
    for request in (item for step in sorted(arrivals) for item in arrivals[step]):
        engine = Engine(model, ByteTokenizer(), EngineConfig(block_size=4, num_pages=256, enable_prefix_caching=False))
        outputs.update(run_to_completion(engine, {0: [request]}))
    return outputs


def test_batched_prefix_hits_and_preemption_change_no_tokens(checkpoint):
    _, path, config = checkpoint
    model = load_model(path, dtype="float32")
    # (for the rich model, seed 4 draws one sample where batched and sequential logprobs, equal to 1e-6,
    # straddle a boundary of the seeded draw)
    arrivals = random_workload(8, seed=4 if config is PLAIN else 5, max_arrival=2, seeded_sampling=True)
    shared = np.random.default_rng(2).integers(0, 256, 20).tolist()  # a prefix deeper than the window
    with_prefix = {step: [(shared + p, params, r) for p, params, r in items] for step, items in arrivals.items()}
    pages = sum(block_costs(kv_groups(model.layer_specs())))  # a block of each group
    for workload, num_pages in ((with_prefix, 256), (arrivals, 18 * pages)):  # roomy with hits; small enough to preempt
        engine = Engine(model, ByteTokenizer(), EngineConfig(block_size=4, num_pages=num_pages,
                                                             max_num_batched_tokens=32))
        expected = sequential_outputs(model, workload)
        assert run_to_completion(engine, {k: list(v) for k, v in workload.items()}) == expected
        stats = engine.stats()
        assert stats.prefix_hit_rate > 0.1 if workload is with_prefix else stats.num_preemptions > 0


def test_two_ranks_give_one_ranks_tokens_and_logprobs(checkpoint):
    from test_tensor_parallel import TP, load_engine

    _, path, config = checkpoint
    arrivals = random_workload(6, seed=6, max_arrival=2, seeded_sampling=True)
    for items in arrivals.values():
        items[:] = [(p, dataclasses.replace(params, logprobs=2), r) for p, params, r in items]
    expected = run_outputs(load_engine(path, dtype="float32"), {k: list(v) for k, v in arrivals.items()})
    sharded = load_engine(path, TP, dtype="float32")
    try:
        attn = sharded.runner.model.model.layers[2].self_attn  # a global layer
        assert attn.num_heads == config["num_attention_heads"] // TP
        outputs = run_outputs(sharded, {k: list(v) for k, v in arrivals.items()})
    finally:
        sharded.close()
    assert {r: o.token_ids for r, o in outputs.items()} == {r: o.token_ids for r, o in expected.items()}
    for r, output in outputs.items():
        ours = np.array([[t.logprob, *(lp for _, lp in t.top)] for t in output.logprobs])
        theirs = np.array([[t.logprob, *(lp for _, lp in t.top)] for t in expected[r].logprobs])
        assert np.abs(ours - theirs).max() < 1e-4


def test_tensor_parallel_refuses_heads_that_do_not_split(tmp_path):
    from tinymlx.models import check_tensor_parallel

    config = transformers.Gemma4TextConfig(**dict(RICH, num_global_key_value_heads=1)).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="KV heads of 1-head layers"):  # one global KV head: not over two ranks
        check_tensor_parallel(tmp_path, "float32", 2)


@pytest.mark.parametrize(("dtype", "tolerance"), [("q8", 0.05), ("q4", 0.7)])
def test_quantized_load_and_run(tmp_path, dtype, tolerance):
    """Every linear, the experts and both embeddings quantized: the mean error is bounded, relative to the
    logits' size (a dropped term or a wrong expert gives 100% and more)."""
    path = tmp_path / "m"
    # whole groups of 64; q/k norms of 0.25 keep its attention (scaled by 1) from amplifying every rounding
    hf_checkpoint(path, dict(RICH, hidden_size_per_layer_input=64), std=0.05, qk_norm=0.25)
    tokens = np.random.default_rng(0).integers(0, 300, 40).tolist()
    reference = np.array(dense_logits(load_model(path, dtype="float32"), tokens))
    quantized = load_model(path, dtype=dtype)
    assert "scales" in quantized.model.layers[0].experts.switch_glu.gate_proj
    assert "scales" in quantized.model.embed_tokens_per_layer
    error = np.abs(np.array(dense_logits(quantized, tokens)) - reference).mean()
    assert error < tolerance * np.abs(reference).mean(), error / np.abs(reference).mean()


def test_a_gemma4_config_loads_the_text_model_and_refuses_a_vision_encoder_it_lacks(checkpoint, tmp_path):
    """model_type gemma4: the text model's config under text_config, its weights under model.language_model
    (transformers 5.x). Without a vision_config the text model loads alone (an audio tower's tensors dropped);
    with one the vision encoder loads too (test_gemma4_vl.py), so a checkpoint holding only part of its tensors
    is refused, naming a missing one."""
    from safetensors.numpy import load_file, save_file

    hf_model, path, config = checkpoint
    text = json.loads((path / "config.json").read_text())
    (tmp_path / "mm").mkdir()
    weights = {name.replace("model.", "model.language_model.", 1): value
               for name, value in load_file(path / "model.safetensors").items()}
    weights["model.audio_tower.layers.0.feed_forward1.ffw_layer_1.linear.weight"] = np.zeros((4, 4), np.float32)
    weights["model.embed_audio.embedding_projection.weight"] = np.zeros((4, 4), np.float32)
    weights["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = np.zeros((4, 4), np.float32)
    weights["model.embed_vision.embedding_projection.weight"] = np.zeros((4, 4), np.float32)
    save_file(weights, tmp_path / "mm" / "model.safetensors")

    def write_config(**towers) -> None:
        (tmp_path / "mm" / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text, **towers}))

    write_config(vision_config=None, audio_config={"model_type": "gemma4_audio"})
    model = load_model(tmp_path / "mm", dtype="float32")
    assert not model.sees_images and model.args.model_type == "gemma4_text"
    tokens = np.random.default_rng(3).integers(0, 300, 20).tolist()
    assert max_diff(dense_logits(model, tokens), hf_logits(hf_model, tokens)) < ATOL
    write_config(vision_config={"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                                "head_dim": 8, "patch_size": 4, "pooling_kernel_size": 2})
    with pytest.raises(ModelLoadError, match=r"vision\.(vision_tower|embed_vision)\.\S+ is missing"):
        load_model(tmp_path / "mm", dtype="float32")


def test_unsupported_variants_name_what_is_missing(tmp_path):
    def load(config: dict):
        (tmp_path / "config.json").write_text(json.dumps(config))
        return load_model(tmp_path)

    with pytest.raises(ModelLoadError, match="without a text_config has no text model"):
        load({"model_type": "gemma4", "vision_config": {"model_type": "gemma4_vision"}})
    with pytest.raises(ModelLoadError, match="'gemma4_vision' is not supported"):
        load({"model_type": "gemma4_vision", "hidden_size": 32})
    text = dict(PLAIN, model_type="gemma4_text")
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention='all'"):
        load(dict(text, use_bidirectional_attention="all"))
    with pytest.raises(ModelLoadError, match="lacks 'num_experts'"):
        load(dict(text, enable_moe_block=True))
    with pytest.raises(ModelLoadError, match=r"per_layer_config sets \['intermediate_size'\]"):
        load(dict(text, per_layer_config={"2": {"intermediate_size": 8}}))


def test_a_new_engine_resumes_from_the_disk_tier_piece_by_piece(checkpoint, tmp_path):
    """The disk tier keeps each piece of the 32-wide global layers and the 16-wide sliding ones: a new engine
    (an empty memory cache) takes every full block of a prompt four windows long from disk and writes the
    same tokens as an uncached run."""
    _, path, _ = checkpoint
    model = load_model(path, dtype="float32")

    def engine(**config) -> Engine:
        return Engine(model, ByteTokenizer(), EngineConfig(block_size=4, num_pages=128, **config))

    prompt = np.random.default_rng(3).integers(0, 300, 34).tolist()
    def workload() -> dict:  # (run_to_completion takes its arrivals)
        return {0: [(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), "r")]}

    expected = run_to_completion(engine(enable_prefix_caching=False), workload())
    first = engine(disk_cache_dir=str(tmp_path / "disk"))
    assert run_to_completion(first, workload()) == expected
    first.close()
    restarted = engine(disk_cache_dir=str(tmp_path / "disk"))
    assert run_to_completion(restarted, workload()) == expected
    assert restarted.stats().disk_cache.num_hits == (len(prompt) - 1) // 4
