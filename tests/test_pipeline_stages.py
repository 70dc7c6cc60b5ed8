"""A model loaded as pipeline stages (each reading only its own tensors), run one after the other, gives the
whole model's logits: every family whose decoder stack is qwen2.py's or gemma3.py's."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from dense_attention import DenseAttention
from mlx.utils import tree_flatten
from tiny_models import ByteTokenizer, random_workload, run_to_completion
from vision_checkpoints import qwen2_5_vl_checkpoint

from tinymlx import SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.core.layer_specs import SharedKV, SlidingWindow, attending_spec
from tinymlx.core.pipeline_stage import PipelineStage
from tinymlx.engine.engine import Engine
from tinymlx.models import load_model, stage_costs
from tinymlx.parallel.pipeline_group import plan_stages
from tinymlx.parallel.stage_split import split_layers
from tinymlx.runner.model_runner import ModelRunner

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hybrid_checkpoints  # noqa: E402 - after the skips: both need transformers
import test_families  # noqa: E402
import test_gemma4  # noqa: E402

CHECKPOINTS = {  # variant: (its writer, config overrides): four or five layers, so three stages split unevenly
    "qwen2": (test_families.hf_checkpoint, {"num_hidden_layers": 5}),
    "qwen3-tied": (test_families.hf_checkpoint, {"num_hidden_layers": 5}),
    "qwen3_moe": (test_families.hf_checkpoint, {"num_hidden_layers": 4, "mlp_only_layers": [1]}),
    "gemma3_text": (test_families.hf_checkpoint, {"num_hidden_layers": 5}),
    "qwen3_5_text": (hybrid_checkpoints.hf_checkpoint, {}),
    "gemma4_text": (lambda path, variant: test_gemma4.hf_checkpoint(path, test_gemma4.PLAIN), {}),  # six layers
}


def dense_run(model, tokens: mx.array, hidden: mx.array | None = None) -> mx.array:
    specs = model.layer_specs()
    windows = [attending_spec(specs, layer).window if isinstance(attending_spec(specs, layer), SlidingWindow) else None
               for layer in range(len(specs))]
    sources = {layer: spec.source for layer, spec in enumerate(specs) if isinstance(spec, SharedKV)}
    return model(tokens, mx.arange(tokens.size), DenseAttention(1, tokens.size, windows, sources), hidden=hidden)


@pytest.mark.kernel_paths("portable", "cpu")
@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("variant", list(CHECKPOINTS))
def test_stages_in_turn_give_the_whole_models_logits_and_each_holds_only_its_part(tmp_path, variant, num_stages,
                                                                                   kernel_path):
    write, overrides = CHECKPOINTS[variant]
    write(tmp_path / "m", variant, **overrides)
    whole = load_model(tmp_path / "m", dtype="float32")
    tokens = mx.array([3, 17, 250, 9, 41, 41, 7, 120, 66, 5, 18, 299])
    want = whole.logits(dense_run(whole, tokens))

    num_layers = whole.args.num_hidden_layers
    ranges = split_layers([1] * num_layers, num_stages)
    held: list[set[str]] = []
    hidden = None
    for index, layers in enumerate(ranges):
        stage = load_model(tmp_path / "m", dtype="float32", stage=PipelineStage(index, num_stages, layers))
        names = {name for name, _ in tree_flatten(stage.parameters())}
        assert all(int(name.split(".")[2]) in layers for name in names if name.startswith("model.layers."))
        assert ("model.norm.weight" in names) == (index == num_stages - 1)
        held.append(names)
        hidden = dense_run(stage, tokens, hidden)
        if index < num_stages - 1:
            assert hidden.shape == (tokens.size, whole.args.hidden_size)  # every row, for the next stage
    assert mx.abs(stage.logits(hidden) - want).max().item() < 1e-4
    # Together the stages hold the whole model, each layer once (a tied embedding twice: lookup and head).
    whole_names = {name for name, _ in tree_flatten(whole.parameters())}
    assert set().union(*held) == whole_names
    assert sum(len(h) for h in held) - len(whole_names) == (
        1 if whole.args.tie_word_embeddings and num_stages > 1 else 0)


def bytes_read() -> int:
    """Bytes this process has read through read calls (/proc/self/io: Linux)."""
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar")).split()[1])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts reads through Linux's /proc/self/io")
def test_each_stage_reads_only_its_own_tensors_from_the_files(tmp_path):
    test_families.hf_checkpoint(tmp_path / "m", "qwen2", num_hidden_layers=8, hidden_size=256, intermediate_size=1024)
    file_bytes = (tmp_path / "m" / "model.safetensors").stat().st_size
    load_model(tmp_path / "m", dtype="float32")  # once first: what a load reads besides the tensors is cached
    before = bytes_read()
    load_model(tmp_path / "m", dtype="float32")
    whole = bytes_read() - before
    assert whole >= file_bytes
    for index, layers in enumerate((range(0, 4), range(4, 8))):
        before = bytes_read()
        load_model(tmp_path / "m", dtype="float32", stage=PipelineStage(index, 2, layers))
        assert bytes_read() - before < 0.55 * whole  # four of eight layers, and one small end each


@pytest.mark.parametrize(("variant", "num_pages"), [("qwen3-tied", 40), ("gemma3_text", 100), ("qwen3_5_text", 60)])
def test_stage_runners_on_the_engines_own_batches_give_its_logits_at_every_step(tmp_path, variant, num_pages):
    """Each stage's runner keeps the K/V (and recurrent states) of its own layers in pages the one scheduler
    hands out: through prefix hits and preemptions, the last stage's logits are the whole model's."""
    write, overrides = CHECKPOINTS[variant]
    write(tmp_path / "m", variant, **overrides)
    engine = Engine(load_model(tmp_path / "m", dtype="float32"), ByteTokenizer(),
                    EngineConfig(block_size=4, num_pages=num_pages, max_num_batched_tokens=24, max_num_seqs=6))
    engine.run_ahead.is_enabled = False
    ranges = split_layers([1] * engine.runner.model.args.num_hidden_layers, 2)
    stages = [ModelRunner(load_model(tmp_path / "m", dtype="float32", stage=PipelineStage(i, 2, layers)), engine.config)
              for i, layers in enumerate(ranges)]
    whole_run, differences = engine.runner.run, []

    def run_through_the_stages_too(batch):
        logits = whole_run(batch)
        hidden = None
        for runner in stages:
            inputs = runner.prepare(batch)
            hidden = runner.forward(inputs, hidden=hidden)
        staged = stages[-1].model.logits(hidden)
        mx.eval(staged, *(runner._pools for runner in stages))
        if inputs.sample_index.size:
            differences.append(mx.abs(staged - logits).max().item())
        return logits

    engine.runner.run = run_through_the_stages_too
    prefix = list(range(40, 72))  # the first request's prompt, which half the later ones begin with: prefix hits
    arrivals = {0: [(prefix, SamplingParams(max_tokens=2, ignore_eos=True), "first")]}
    for step, requests in random_workload(10, seed=3, max_arrival=6).items():
        arrivals[step + 8] = [(prefix + prompt if i % 2 else prompt, params, rid)
                              for i, (prompt, params, rid) in enumerate(requests)]
    run_to_completion(engine, arrivals)
    assert engine.stats().num_preemptions > 0 and engine.stats().prefix_hit_rate > 0
    assert len(differences) > 20 and max(differences) < 1e-4


def test_gemma4s_shared_layers_stay_with_their_source_and_its_per_layer_inputs_are_handed_on(tmp_path):
    """KV sharing (layers 3-5 read layers 1 and 2's K/V), per-layer inputs, an MoE block: the only two stages that
    keep every shared layer with its source give the whole model's logits; three cannot be made."""
    test_gemma4.hf_checkpoint(tmp_path / "g", test_gemma4.RICH)
    whole = load_model(tmp_path / "g", dtype="float32")
    tokens = mx.array([3, 17, 250, 9, 41, 41, 7, 120, 66, 5, 18, 299])
    costs = stage_costs(tmp_path / "g", 1024)
    assert costs.cuts == (1,)
    hidden = None
    for stage in plan_stages(costs, 2):
        model = load_model(tmp_path / "g", dtype="float32", stage=stage)
        hidden = dense_run(model, tokens, hidden)
        if not stage.is_last:  # the hidden states, and every layer's per-layer inputs beside them
            assert hidden.shape == (tokens.size, whole.args.hidden_size + 6 * 8)
    assert mx.abs(model.logits(hidden) - whole.logits(dense_run(whole, tokens))).max().item() < 1e-4
    with pytest.raises(ValueError, match="cannot be split into 3 pipeline stages that keep every KV-shared layer"):
        plan_stages(costs, 3)


def test_a_vision_model_is_refused_by_name(tmp_path):
    qwen2_5_vl_checkpoint(tmp_path / "v")
    with pytest.raises(ValueError, match="qwen2_5_vl models cannot be split into pipeline stages yet"):
        load_model(tmp_path / "v", dtype="float32", stage=PipelineStage(0, 2, range(0, 1)))
