"""MTP heads as a proposer (speculative="mtp"): a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint's own
multi-token-prediction head, in Hugging Face's layout and mlx-lm's, drafts from the target's hidden states.

The outputs equal the non-speculative run's for any head. A random head's drafts are rarely kept, so a
head is also trained here (a few hundred Adam steps on the target's own greedy continuations, through the
dense reference attention) until it agrees with the target: run through the engine, its first drafts must
then be kept, which holds only if the head's forward, the hidden states it reads and its paged K/V are all
right."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from dense_attention import DenseAttention
from hybrid_checkpoints import hf_checkpoint
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file
from tiny_models import ByteTokenizer, run_outputs, run_to_completion, save_dir, tiny_model

from tinymlx import Engine, EngineConfig, SamplingParams
from tinymlx.core.errors import ModelLoadError
from tinymlx.models import HeadInput, MTPModel, load_model, load_mtp_head

pytest.importorskip("torch")
pytest.importorskip("transformers")

HYBRIDS = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]
_NORMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "pre_fc_norm_embedding.weight",
          "pre_fc_norm_hidden.weight")


def add_mtp_weights(model_dir: Path, layout: str, seed: int = 0, num_layers: int = 1) -> dict[str, mx.array]:
    """Random MTP weights written into the checkpoint as `layout` ("hf": norms as offsets from 1, one tensor
    per expert; "mlx": norms as stored, experts stacked); returns them named as the head's module tree."""
    target = load_model(model_dir, dtype="float32")
    body, _ = target.mtp_head({f"mtp.layers.{i}.input_layernorm.weight": mx.zeros(1) for i in range(num_layers)})
    mx.random.seed(seed)
    weights = {name: mx.random.normal(p.shape) * (0.2 if p.ndim > 1 else 0.1) + (p.ndim == 1)
               for name, p in tree_flatten(body.parameters())}
    stored = {}
    for name, value in weights.items():
        if layout == "hf" and (name == "norm.weight" or name.endswith(_NORMS)):
            value = value - 1.0
        if layout == "hf" and ".switch_mlp." in name:  # one linear per expert, as transformers 4.x stores them
            prefix, proj = name.split(".switch_mlp.")
            for e in range(value.shape[0]):
                stored[f"mtp.{prefix}.experts.{e}.{proj}"] = np.array(value[e])
            continue
        stored[f"mtp.{name}"] = np.array(value)
    path = model_dir / "model.safetensors"
    checkpoint = load_file(str(path))
    if layout == "mlx":  # mlx-lm's converted layout for the rest: conv1d [C, K, 1], norms holding 1 + w
        for name in list(checkpoint):
            if name.endswith("conv1d.weight"):
                checkpoint[name] = np.ascontiguousarray(np.moveaxis(checkpoint[name], 2, 1))
            elif name.endswith((".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                                ".q_norm.weight", ".k_norm.weight")):
                checkpoint[name] = checkpoint[name] + 1.0
    save_file({**checkpoint, **stored}, str(path), metadata={"format": "pt"})
    return weights


def engine(model_dir: Path, speculative: str | None = None, head: MTPModel | None = None, **config) -> Engine:
    settings = dict(block_size=4, num_pages=256, max_num_batched_tokens=32, enable_prefix_caching=True)
    target = load_model(model_dir, dtype="float32")
    if speculative and head is None:
        head = load_mtp_head(model_dir, target)
    elif head is not None:
        head = MTPModel(target, head.model)
    return Engine(target, ByteTokenizer(), EngineConfig(speculative=speculative, **{**settings, **config}),
                  draft_model=head)


def workload(n: int = 8, seed: int = 3) -> dict[int, list[tuple]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 256, 20).tolist()
    arrivals: dict[int, list[tuple]] = {}
    for i in range(n):
        prompt = (shared if i % 2 else []) + rng.integers(0, 256, int(rng.integers(4, 30))).tolist()
        temperature, request_seed = (0.0, None) if i % 3 else (0.9, i)
        params = SamplingParams(temperature=temperature, seed=request_seed, max_tokens=int(rng.integers(5, 16)),
                                ignore_eos=True, logprobs=1)
        arrivals.setdefault(0 if i < 2 else int(rng.integers(1, 4)), []).append((prompt, params, f"r{i}"))
    return arrivals


def copy_of(arrivals: dict[int, list[tuple]]) -> dict[int, list[tuple]]:
    return {step: list(items) for step, items in arrivals.items()}


@pytest.mark.parametrize("layout", ["hf", "mlx"])
@pytest.mark.parametrize("variant", HYBRIDS)
def test_the_head_loads_in_both_layouts_and_changes_no_token(tmp_path, variant, layout):
    hf_checkpoint(tmp_path / "m", variant)
    weights = add_mtp_weights(tmp_path / "m", layout)
    head = load_mtp_head(tmp_path / "m", load_model(tmp_path / "m", dtype="float32"))
    loaded = dict(tree_flatten(head.model.parameters()))
    assert all(mx.allclose(loaded[name], value, atol=1e-6) for name, value in weights.items())  # norms shifted back
    plain = run_to_completion(engine(tmp_path / "m"), copy_of(workload()))
    for config in ({}, {"num_pages": 30}):  # roomy, and small enough to preempt
        spec = engine(tmp_path / "m", "mtp:3,adaptive=0", **config)
        assert run_to_completion(spec, copy_of(workload())) == plain
        stats = spec.stats()
        assert stats.num_draft_tokens > 0 and stats.state_slots.num_live_used == 0
        assert stats.num_preemptions > 0 if config else stats.state_slots.num_resumed > 0


@pytest.mark.parametrize("variant", ["qwen3_5_text", "qwen3_next"])
def test_chained_drafts_equal_the_dense_reference(tmp_path, variant):
    """The head's drafts for a sequence's next step, through the engine's paged pool, against the head run
    densely: over the target's hidden states at 0..q with tokens 1..q+1, then on from its own state."""
    hf_checkpoint(tmp_path / "m", variant)
    add_mtp_weights(tmp_path / "m", "hf", seed=2)
    spec = engine(tmp_path / "m", "mtp:3,adaptive=0")
    runner, logits_seen = spec.speculation.proposers["mtp"].runner, []
    run = runner.run_with_context

    def recording(batch, context):  # the head's logits, pass by pass
        logits, out = run(batch, context)
        logits_seen.append(logits)
        return logits, out

    runner.run_with_context = recording
    spec.add_request(np.random.default_rng(1).integers(0, 256, 37).tolist(),
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), request_id="r")
    while spec.requests.get("r").seq.num_computed_tokens < 37:  # the prompt, in chunks of up to 32
        spec.step()
    (chunk,) = spec.stages.plan(spec.scheduler.schedule()).chunks
    tokens = spec.requests.get("r").seq.token_ids  # the prompt and the token the last step sampled
    target, head = spec.runner.model, spec.speculation.proposers["mtp"].runner.model
    q = len(tokens) - 2
    hidden = target(mx.array(tokens[:q + 1]), mx.arange(q + 1), DenseAttention(1, q + 1))
    inputs, drafts = tokens[1:], []
    for depth, paged in zip(range(3), logits_seen[-3:]):  # the last prefill pass's, then two chained
        n = hidden.shape[0]
        out = head(mx.array(inputs), mx.arange(n), DenseAttention(1, n), None, HeadInput(hidden, depth))
        dense = head.logits(out[-1:])
        assert mx.abs(paged - dense).max().item() < 1e-4
        drafts.append(mx.argmax(dense, axis=-1).item())
        hidden, inputs = mx.concatenate([hidden, out[-1:]]), inputs + drafts[-1:]
    assert chunk.draft_token_ids == drafts


def hidden_and_tokens(target, sequences: list[list[int]]) -> tuple[mx.array, mx.array, mx.array]:
    """For every position p < L - 2 of each sequence: the target's final hidden state h_p, the token x_{p+1},
    and the target's greedy choice at p + 1 (the token the head should guess), stacked."""
    hidden, next_tokens, wanted = [], [], []
    for tokens in sequences:
        n = len(tokens)
        h = target(mx.array(tokens), mx.arange(n), DenseAttention(1, n))
        greedy = mx.argmax(target.logits(h), axis=-1)
        hidden.append(h[:-2])
        next_tokens.append(mx.array(tokens[1:-1]))
        wanted.append(greedy[1:-1])
    return hidden, next_tokens, wanted


def train_head(target, body, sequences: list[list[int]], steps: int = 300) -> None:
    """Fit the head to the target's greedy continuations, each sequence through dense causal attention."""
    hidden, next_tokens, wanted = hidden_and_tokens(target, sequences)
    embed = target.model.embed_tokens

    def loss_fn(model):
        total = 0.0
        for h, x, y in zip(hidden, next_tokens, wanted):
            n = h.shape[0]
            out = model(embed(x), mx.arange(n), DenseAttention(1, n), None, HeadInput(h))
            total = total + nn.losses.cross_entropy(target.logits(out), y, reduction="mean")
        return total / len(hidden)

    optimizer = optim.Adam(learning_rate=1e-2)
    step = nn.value_and_grad(body, loss_fn)
    for _ in range(steps):
        loss, grads = step(body)
        optimizer.update(body, grads)
        mx.eval(body.parameters(), optimizer.state)
    assert loss.item() < 0.3, f"the head did not fit the target ({loss.item():.3f})"


def test_a_head_that_agrees_with_the_target_gets_its_drafts_kept(tmp_path):
    hf_checkpoint(tmp_path / "m", "qwen3_5_text")
    add_mtp_weights(tmp_path / "m", "hf")
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (13, 22, 31, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    arrivals = {0: [(p, params, f"r{i}") for i, p in enumerate(prompts)]}
    plain = run_outputs(engine(tmp_path / "m"), copy_of(arrivals))
    target = load_model(tmp_path / "m", dtype="float32")
    body = load_mtp_head(tmp_path / "m", target).model
    body.embed_tokens.freeze()  # the target's own: trained around, never changed
    train_head(target, body, [p + plain[f"r{i}"].token_ids for i, p in enumerate(prompts)])
    trained = MTPModel(target, body)
    # One draft a step: each verifies the head's first guess, made from the target's real hidden states.
    spec = engine(tmp_path / "m", "mtp:1,adaptive=0", head=trained)
    outputs = run_outputs(spec, copy_of(arrivals))
    assert {r: o.token_ids for r, o in outputs.items()} == {r: o.token_ids for r, o in plain.items()}
    stats = spec.stats()
    assert stats.num_draft_tokens >= 40 and stats.acceptance_rate > 0.8, stats.acceptance_rate
    # Chained drafts read the head's own state: fewer are kept, but they are still drafts of the head.
    chained = engine(tmp_path / "m", "mtp:3,adaptive=0", head=MTPModel(load_model(tmp_path / "m", dtype="float32"), body))
    assert run_to_completion(chained, copy_of(arrivals)) == {r: o.token_ids for r, o in plain.items()}
    assert chained.stats().mean_accepted_length > 1.5


def test_a_checkpoint_without_mtp_weights_says_so_at_load(tmp_path):
    hf_checkpoint(tmp_path / "m", "qwen3_5_text")
    with pytest.raises(ModelLoadError, match="has no mtp.* weights"):
        load_mtp_head(tmp_path / "m", load_model(tmp_path / "m", dtype="float32"))
    dense = save_dir(tmp_path / "dense", tiny_model())
    with pytest.raises(ModelLoadError, match="qwen2 models have none"):
        load_mtp_head(dense, load_model(dense, dtype="float32"))
    with pytest.raises(ValueError, match="needs the checkpoint's MTP head"):
        Engine(load_model(dense, dtype="float32"), ByteTokenizer(), EngineConfig(num_pages=64, speculative="mtp"))
    with pytest.raises(ValueError, match="speculative='mtp' is not supported with tensor parallelism"):
        EngineConfig(speculative="mtp", tensor_parallel_size=2)


def test_mtp_settings_parse():
    assert EngineConfig(speculative="mtp").speculative_config.max_draft_tokens == 3
    assert EngineConfig(speculative="mtp:2").speculative_config.max_draft_tokens == 2
    config = EngineConfig(speculative="mtp:max_draft=4,adaptive=0").speculative_config
    assert (config.proposers, config.max_draft_tokens, config.adaptive) == (("mtp",), 4, False)
    with pytest.raises(ValueError, match="speculative option 'max_draft=0'"):
        EngineConfig(speculative="mtp:0")
