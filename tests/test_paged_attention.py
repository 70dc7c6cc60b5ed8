"""The paged forward equals dense attention (sliding windows included), and a tiny random Qwen2/Llama equals
Hugging Face (the other families: test_families.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import dense_logits, paged_logits, tiny_model

from tinymlx.core.batch import ScheduledBatch, ScheduledChunk
from tinymlx.core.config import EngineConfig
from tinymlx.ops.attention import visible_keys
from tinymlx.ops.cpu import fast_math, host_math, power_softmax
from tinymlx.runner.model_runner import ModelRunner

ATOL = 1e-4


def max_diff(a, b) -> float:
    return float(mx.abs(mx.array(a) - mx.array(b)).max())


SLIDING = {"sliding_window": 6, "sliding_window_pattern": 2}  # windows of 6 over 45 tokens, every other layer


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("model_type", "overrides"), [("qwen2", {}), ("llama", {}), ("gemma3_text", SLIDING),
                                                       ("qwen3", {"use_sliding_window": True, "sliding_window": 5,
                                                                  "max_window_layers": 0})])
@pytest.mark.parametrize("query_tile", [64, 6])  # 6: the prompt's queries run as tiles in several groups
def test_paged_prefill_and_decode_equal_dense(block_size, model_type, overrides, query_tile, kernel_path):
    model = tiny_model(model_type=model_type, **overrides)
    rng = np.random.default_rng(block_size)
    tokens = rng.integers(0, 256, 45).tolist()  # prompt of 37 crosses several block boundaries
    reference = dense_logits(model, tokens)
    for chunk_size in (None, 5):
        paged = paged_logits(model, tokens, prompt_len=37, block_size=block_size, chunk_size=chunk_size,
                             query_tile=query_tile)
        assert len(paged) == 45 - 37 + 1
        for step, logits in enumerate(paged):
            assert max_diff(logits, reference[36 + step]) < ATOL, (chunk_size, step)


@pytest.mark.parametrize("query_tile", [64, 4, 3])
def test_mixed_batch_equals_dense(query_tile, kernel_path):
    """One forward: a decode, a prefill chunk, a prompt's last chunk and a whole prompt.
    Small query tiles split the chunks into pieces across groups (3: some pieces are single tokens)."""
    model = tiny_model(seed=3)
    block_size = 4
    config = EngineConfig(block_size=block_size, num_pages=64).resolve(model.args, mx.float32)
    runner = ModelRunner(model, config, query_tile=query_tile)
    rng = np.random.default_rng(0)
    seqs = {i: rng.integers(0, 256, n).tolist() for i, n in enumerate([11, 30, 19, 6])}
    tables = {0: [5, 9, 2], 1: [40, 41, 7, 8, 60, 61, 62, 63], 2: [30, 31, 32, 33, 34], 3: [50, 51]}
    tables = {seq_id: (tuple(table),) for seq_id, table in tables.items()}  # one KV group

    # Step 1 fills the caches up to: seq0 10 tokens, seq1 10, seq2 12; seq3 not started.
    first = [ScheduledChunk(0, seqs[0][:10], 0, tables[0], False),
             ScheduledChunk(1, seqs[1][:10], 0, tables[1], False),
             ScheduledChunk(2, seqs[2][:12], 0, tables[2], False)]
    runner.run(ScheduledBatch(first, 32, []))

    # Step 2 mixes: seq0 decodes token 10, seq1 prefills 10..19 (no sample), seq2 finishes its
    # prompt 12..18, seq3 prefills its whole 6-token prompt; chunks deliberately out of order.
    second = [ScheduledChunk(1, seqs[1][10:20], 10, tables[1], False),
              ScheduledChunk(0, seqs[0][10:11], 10, tables[0], True),
              ScheduledChunk(2, seqs[2][12:19], 12, tables[2], True),
              ScheduledChunk(3, seqs[3], 0, tables[3], True)]
    logits = runner.run(ScheduledBatch(second, 24, []))
    assert logits.shape == (3, model.args.vocab_size)
    for row, (seq_id, length) in enumerate([(0, 11), (2, 19), (3, 6)]):
        assert max_diff(logits[row], dense_logits(model, seqs[seq_id][:length])[-1]) < ATOL, seq_id

    # Step 3: seq1's last chunk sees the K/V written in both earlier steps.
    third = [ScheduledChunk(1, seqs[1][20:], 20, tables[1], True)]
    logits = runner.run(ScheduledBatch(third, 10, []))
    assert max_diff(logits[0], dense_logits(model, seqs[1])[-1]) < ATOL


def test_a_chunk_splits_into_tiles_of_near_equal_length():
    """85 queries as 42 + 43 (one group, padded by one query), not 64 + 21 (padded to 64 + 64); a chunk
    within one tile stays whole; only the last tile samples. A chunk's tiles alone in their group (a long
    prompt far into its context) are one piece again: the same scores, its context gathered once."""
    model = tiny_model()
    config = EngineConfig(block_size=16, num_pages=64).resolve(model.args, mx.float32)
    runner = ModelRunner(model, config, query_tile=64)
    table = (tuple(range(64)),)
    chunks = [ScheduledChunk(0, list(range(85)), 2368, table, True), ScheduledChunk(1, list(range(64)), 0, table, True),
              ScheduledChunk(2, list(range(130)), 0, table, False),
              ScheduledChunk(3, list(range(8)), 2400, table, True)]  # in seq 0's group: joined, it would pad to 85
    pieces = [piece for group in runner._attention_groups(chunks) for piece in group]
    lengths = {seq: [(len(p.token_ids), p.start_position, p.needs_sample) for p in pieces if p.seq_id == seq]
               for seq in range(4)}
    assert lengths[0] == [(42, 2368, False), (43, 2410, True)]
    assert lengths[1] == [(64, 0, True)]
    assert lengths[2] == [(43, 0, False), (43, 43, False), (44, 86, False)]  # three groups: 3, 6 and 9 blocks
    assert lengths[3] == [(8, 2400, True)]

    alone = runner._attention_groups(chunks[:1])
    assert [[(len(p.token_ids), p.start_position, p.needs_sample) for p in group] for group in alone] == \
        [[(85, 2368, True)]]


@pytest.mark.parametrize("window", [None, 7])
def test_numpy_softmax_equals_mlx_softmax(window):
    """The CPU's numpy softmax (natural-log scores) against MLX's (log2 scores) on [KV, B, group, L, T] scores
    under a causal or windowed mask: hidden keys weigh exactly 0, even where their scores would dominate the
    row's maximum (a future key scored 80 above every visible one)."""
    rng = np.random.default_rng(0)
    L, T = 5, 40
    scores = rng.normal(0, 3, (2, 3, 4, L, T)).astype(np.float32)
    scores[..., -1] = 80.0  # the last key is visible to no query below: positions end at T - 2
    positions = mx.array(np.arange(T - L - 1, T - 1))[None].astype(mx.int32) + mx.zeros((3, 1), mx.int32)
    visible = visible_keys(positions, mx.broadcast_to(mx.arange(T)[None], (3, T)), window)[None, :, None]
    weights, total = host_math.unnormalized_softmax(mx.array(scores), visible)
    expected, expected_total = power_softmax(mx.array(scores) * fast_math.LOG2E, visible)
    assert bool(mx.all(mx.where(visible, 0, weights) == 0))
    assert float(weights.max()) == 1.0  # each row's largest visible score
    assert max_diff(weights, expected) < 1e-6 and max_diff(total, expected_total) < 1e-5
    assert max_diff(weights / total, mx.softmax(mx.where(visible, mx.array(scores), -mx.inf), axis=-1)) < 1e-6


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
@pytest.mark.kernel_paths("portable", "cpu")
def test_tiny_random_model_matches_hugging_face(model_type, kernel_path):
    """Our forward on HF's own random weights: prefill and 32 teacher-forced decode steps."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tinymlx.models import args_from_config, build_model

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if model_type == "qwen2":
        hf_config = transformers.Qwen2Config(**common)
        hf_model = transformers.Qwen2ForCausalLM(hf_config)
    else:
        hf_config = transformers.LlamaConfig(**common, attention_bias=False)
        hf_model = transformers.LlamaForCausalLM(hf_config)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in hf_model.parameters():  # beyond HF's tiny init, so every term matters
            param.normal_(0, 0.3)
    hf_model.eval()

    model = build_model(args_from_config(hf_config.to_dict()))
    model.load_weights([(k, mx.array(v.numpy())) for k, v in hf_model.state_dict().items()], strict=True)

    tokens = np.random.default_rng(1).integers(0, 300, 20 + 32).tolist()
    with torch.no_grad():
        reference = hf_model(torch.tensor([tokens])).logits[0].numpy()
    for block_size in (1, 4, 16):
        paged = paged_logits(model, tokens, prompt_len=20, block_size=block_size, chunk_size=7)
        assert len(paged) == 33
        for step, logits in enumerate(paged):
            assert max_diff(logits, reference[19 + step]) < 5e-4, (block_size, step)
