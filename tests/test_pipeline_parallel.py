"""Pipeline parallelism: stage workers on loopback against the one-process engine.

Rank 0 runs the last stage, schedules and samples; each worker process runs one stage before it, and the
hidden states flow between them over TCP (parallel/stage_link.py). Every test starts its own workers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import ByteTokenizer, random_workload, run_outputs, save_byte_tokenizer, save_dir, tiny_model

from tinymlx import Engine, EngineConfig, SamplingParams
from tinymlx.core import config as config_module
from tinymlx.core.batch import ScheduledBatch, ScheduledChunk, StateAccess
from tinymlx.ops.kernels import PORTABLE_ENV
from tinymlx.parallel.pipeline_group import PipelineGroup, PipelineParallelError
from tinymlx.parallel.pipeline_runner import micro_batches
from tinymlx.text.tokenizer import Tokenizer

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hybrid_checkpoints  # noqa: E402 - after the skips: both need transformers
import test_families  # noqa: E402
import test_gemma4  # noqa: E402
import test_gpt_oss  # noqa: E402

SCENARIOS = Path(__file__).with_name("pipeline_scenarios.py")
PREFIX = list(range(40, 72))  # the first request's prompt, which every other later one begins with: prefix hits


def load_engine(model_dir: Path, pipeline_parallel_size: int = 1, tokenizer=None, **config) -> Engine:
    config = EngineConfig(pipeline_parallel_size=pipeline_parallel_size, **{"block_size": 4, **config})
    return Engine.load(model_dir, tokenizer or ByteTokenizer(), config, "tiny")


def workload(n: int = 10, seed: int = 3) -> dict[int, list[tuple]]:
    """Greedy and seeded sampling, each token's logprob asked for; a first request whose prompt half the later
    ones begin with (their prefix hits, a hybrid's included: it keeps a checkpoint at its prompt's end)."""
    arrivals = {0: [(PREFIX, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0), "first")]}
    for step, items in random_workload(n=n, seed=seed, max_arrival=6, seeded_sampling=True).items():
        arrivals[step + 8] = [(PREFIX + prompt if i % 2 else prompt, dataclasses.replace(params, logprobs=0), request_id)
                              for i, (prompt, params, request_id) in enumerate(items)]
    return arrivals


def assert_same_outputs(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for request_id, output in want.items():
        assert got[request_id].token_ids == output.token_ids, request_id
        for mine, theirs in zip(got[request_id].logprobs, output.logprobs, strict=True):
            assert abs(mine.logprob - theirs.logprob) < 1e-4, request_id


def run_both(model_dir: Path, num_stages: int, **config) -> Engine:
    """The pipeline's outputs equal one process's, through prefix hits and preemption; returns the pipeline's
    engine, still open (the caller closes it)."""
    want = run_outputs(load_engine(model_dir, **config), workload())
    engine = load_engine(model_dir, num_stages, **config)
    try:
        assert_same_outputs(run_outputs(engine, workload()), want)
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_hit_rate > 0
    except BaseException:
        engine.close()
        raise
    return engine


CHECKPOINTS = {  # variant: (writes the checkpoint at a path, a pool small enough to preempt)
    "qwen3_moe": (lambda path: test_families.hf_checkpoint(path, "qwen3_moe", num_hidden_layers=4, mlp_only_layers=[1]),
                  40),
    "gemma3_text": (lambda path: test_families.hf_checkpoint(path, "gemma3_text", num_hidden_layers=5), 100),
    "qwen3_5_text": (lambda path: hybrid_checkpoints.hf_checkpoint(path, "qwen3_5_text"), 60),
    "gpt_oss": (lambda path: test_gpt_oss.hf_checkpoint(path), 40),
    # KV-shared layers (each stage keeps them with their source: stages [0] and [1, 5]), per-layer inputs handed
    # on from the first stage, an MoE block and K = V.
    "gemma4_text": (lambda path: test_gemma4.hf_checkpoint(path, test_gemma4.RICH), 100),
}


@pytest.mark.parametrize("variant", list(CHECKPOINTS))
def test_two_stages_give_one_process_tokens_and_logprobs(tmp_path, variant):
    write, num_pages = CHECKPOINTS[variant]
    write(tmp_path / "m")
    engine = run_both(tmp_path / "m", 2, num_pages=num_pages, max_num_batched_tokens=24)
    engine.close()


def bytes_read(pid: int) -> int:
    """Bytes a process has read through read calls (/proc/PID/io: Linux)."""
    with open(f"/proc/{pid}/io") as io:
        return int(next(line for line in io if line.startswith("rchar")).split()[1])


def test_three_uneven_stages_each_reading_only_its_layers(tmp_path, monkeypatch):
    """Five layers over three stages; each worker reads its layers' share of the file when it loads (the portable
    kernels: the CPU's read numba's cache at their first load, which is not the model's)."""
    monkeypatch.setenv(PORTABLE_ENV, "1")
    model_dir = save_dir(tmp_path / "m", tiny_model(seed=5, std=0.15, num_hidden_layers=5, hidden_size=128,
                                                    intermediate_size=512, head_dim=32))
    file_bytes = (model_dir / "model.safetensors").stat().st_size
    loads: list[tuple] = []
    load = PipelineGroup.load

    def counted_load(group, model_dir, config, fingerprint):
        before = {pid: bytes_read(pid) for pid in group.pids}
        load(group, model_dir, config, fingerprint)
        loads.append(([len(stage.layers) for stage in group.stages],
                      {pid: bytes_read(pid) - before[pid] for pid in group.pids}))

    monkeypatch.setattr(PipelineGroup, "load", counted_load)
    engine = run_both(model_dir, 3, num_pages=40, max_num_batched_tokens=24)
    pipeline = engine.stats().pipeline
    engine.close()
    assert [stage.layers for stage in pipeline.stages] in ([(0, 1), (1, 3), (3, 5)], [(0, 2), (2, 4), (4, 5)])
    assert all(stage.host == "127.0.0.1" and stage.weights_bytes > 0 and stage.kv_cache_bytes_budget > 0
               and stage.busy_s_total > 0 for stage in pipeline.stages)
    # A stage's weights are its layers' (the ends' too): the stages' add up to the whole model's.
    assert sum(stage.weights_bytes for stage in pipeline.stages) == pytest.approx(file_bytes, rel=0.01)
    assert 0 < pipeline.bubble_fraction < 1 and pipeline.bytes_total > pipeline.bytes_last_step > 0
    # Each stage's pool keeps its own layers' share of every page.
    assert len({stage.kv_cache_bytes_budget / (stage.layers[1] - stage.layers[0]) for stage in pipeline.stages}) == 1
    # The two stages before rank 0's handed on hidden states of one shape, every row of every step.
    first, second, last = (stage.sent_bytes_total for stage in pipeline.stages)
    assert first == second > 0 and last > 0
    (layers, reads), = loads
    assert sorted(layers) == [1, 2, 2]
    # Two of five layers (and the embedding on stage 0): about 40% of the file each, and only that.
    assert all(0.3 * file_bytes < read < 0.5 * file_bytes for read in reads.values()), (reads, file_bytes)


@pytest.mark.parametrize(("sent", "said"), [(signal.SIGKILL, r"rank 1 \(pid \d+\) was killed by signal 9"),
                                             (signal.SIGSTOP, r"rank 1 \(pid \d+\) has given no sign of life for \d+ s")])
def test_a_worker_killed_or_hung_mid_stream_is_an_error_within_seconds_and_no_worker_is_left(tmp_path, sent, said):
    model_dir = save_dir(tmp_path / "m", tiny_model(seed=5, num_hidden_layers=4))
    engine = load_engine(model_dir, 2, num_pages=256)
    pids = engine.pipeline.pids
    engine.add_request(list(range(20)), SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), "long")
    for _ in range(3):
        engine.step()
    os.kill(pids[0], sent)
    stopped = time.monotonic()
    with pytest.raises(PipelineParallelError, match=r"stage 0 \(rank 1\) on 127\.0\.0\.1: " + said):
        while engine.has_unfinished_requests:
            engine.step()
    assert time.monotonic() - stopped < 10
    with pytest.raises(PipelineParallelError, match="pipeline stages failed"):
        engine.check_alive()
    engine.close()
    for pid in pids:  # gone, or a zombie this process has not reaped
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_a_model_too_big_for_one_machines_working_set_runs_as_two_stages(tmp_path, monkeypatch):
    """Given a working set (a Mac's GPU's: here set for rank 0's machine) that holds half the model and its pools
    but not all of it: one process is refused with a clear message, two stages load and give its tokens."""
    model_dir = save_dir(tmp_path / "m", tiny_model(seed=5, std=0.15, num_hidden_layers=4, hidden_size=128,
                                                    intermediate_size=512, head_dim=32))
    config = dict(num_pages=64, max_num_batched_tokens=16, max_model_len=256)
    prompt, params = list(range(30)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = run_outputs(load_engine(model_dir, **config), {0: [(prompt, params, "r")]})["r"].token_ids
    engine = load_engine(model_dir, 2, **config)
    stats = engine.stats()
    engine.close()
    beside_weights = stats.pools_bytes_budget + stats.activation_bytes_budget
    working_set = int((max(stage.weights_bytes for stage in stats.pipeline.stages) + beside_weights) * 1.05 / 0.9)
    whole_weights = sum(stage.weights_bytes for stage in stats.pipeline.stages)
    assert whole_weights + beside_weights > 0.9 * working_set  # one process cannot fit it
    monkeypatch.setattr(config_module, "working_set_bytes", lambda: working_set)
    with pytest.raises(ValueError, match=r"the weights \(.* GiB\) and the KV cache's pools .* do not fit this GPU's "
                                         r"working set"):
        load_engine(model_dir, **config)
    engine = load_engine(model_dir, 2, **config)
    try:
        assert run_outputs(engine, {0: [(prompt, params, "r")]})["r"].token_ids == reference
    finally:
        engine.close()


@pytest.mark.parametrize("speculative", ["ngram", "draft:self"])
def test_speculation_through_the_stages_keeps_every_greedy_token(tmp_path, speculative):
    """The last stage verifies the drafts rank 0 proposes (prompt lookup, or a draft model running whole on rank 0:
    here the target itself, which drafts what it would decode): drafts are accepted, and the tokens are plain
    decoding's."""
    model_dir = save_byte_tokenizer(save_dir(tmp_path / "m", tiny_model(seed=5, num_hidden_layers=4)))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(list(range(40, 52)) * 4, params, "a"), ([9, 8, 7, 6] * 8, params, "b")]}
    tokenizer = Tokenizer.from_dir(model_dir)  # the draft's must be the same
    plain = run_outputs(load_engine(model_dir, num_pages=128), dict(arrivals))
    spec = speculative.replace("self", f"{model_dir},adaptive=0")
    engine = load_engine(model_dir, 2, tokenizer, num_pages=128, speculative=spec)
    try:
        outputs = run_outputs(engine, dict(arrivals))
        assert engine.stats().num_accepted_tokens > 0
    finally:
        engine.close()
    assert {k: o.token_ids for k, o in outputs.items()} == {k: o.token_ids for k, o in plain.items()}


def test_two_stages_of_two_tensor_parallel_ranks_give_one_process_tokens_and_logprobs(tmp_path):
    """PP=2 x TP=2: four ranks, each stage's two over a ring of their own, the hidden states from each rank to the
    next stage's rank of its place. In a process of its own: rank 0 joins its stage's MLX group for good."""
    model_dir = save_dir(tmp_path / "m", tiny_model(seed=5, num_hidden_layers=4))
    arrivals = workload()
    want = run_outputs(load_engine(model_dir, num_pages=40, max_num_batched_tokens=24), workload())
    path = tmp_path / "arrivals.json"
    path.write_text(json.dumps({step: [(prompt, dataclasses.asdict(params), rid) for prompt, params, rid in items]
                                for step, items in arrivals.items()}))
    run = subprocess.run([sys.executable, str(SCENARIOS), str(model_dir), str(path), "2", "2"], capture_output=True,
                         text=True, timeout=300, cwd=SCENARIOS.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["stages"] == [[0, 2], [2, 4]] and got["local_kv_heads"] == 1  # two KV heads over two ranks
    assert got["num_preemptions"] > 0 and got["prefix_hit_rate"] > 0
    assert got["outputs"].keys() == want.keys()
    for request_id, output in want.items():
        tokens, logprobs = got["outputs"][request_id]
        assert tokens == output.token_ids, request_id
        assert max(abs(a - b.logprob) for a, b in zip(logprobs, output.logprobs, strict=True)) < 1e-4


def test_a_tensor_parallel_rank_beside_rank_0_killed_mid_run_is_an_error_within_seconds(tmp_path):
    """Rank 1 holds the other half of the last stage: rank 0's collectives would wait for it forever, so they run
    on a thread of their own while rank 0 watches the workers; then every worker is stopped."""
    model_dir = save_dir(tmp_path / "m", tiny_model(seed=5, num_hidden_layers=4))
    path = tmp_path / "arrivals.json"
    params = dataclasses.asdict(SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))  # 35 pages of 40
    path.write_text(json.dumps({0: [(list(range(20)), params, "long")]}))
    run = subprocess.run([sys.executable, str(SCENARIOS), str(model_dir), str(path), "2", "2", "1"],
                         capture_output=True, text=True, timeout=300, cwd=SCENARIOS.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert re.search(r"stage 1 \(rank 1\) on 127\.0\.0\.1: rank 1 \(pid \d+\) was killed by signal 9", got["error"])
    assert got["seconds_to_error"] < 10
    for pid in got["worker_pids"]:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_a_stage_that_cannot_load_or_builds_other_shapes_is_an_error_naming_it(tmp_path):
    """A worker whose model is not there, or is another model, fails the load with its own error; its workers stop."""
    model_dir = save_dir(tmp_path / "m", tiny_model(seed=5, num_hidden_layers=4))
    other_dir = save_dir(tmp_path / "o", tiny_model(seed=5, num_hidden_layers=4, hidden_size=128, head_dim=32))
    for where, config_model, said in ((tmp_path / "absent", str(tmp_path / "absent"),
                                       r"stage 0 \(rank 1\) failed to load .*absent: ModelLoadError"),
                                      (other_dir, None, r"stage 0 \(rank 1\) built other shapes than rank 0 \(hidden")):
        engine = load_engine(model_dir, 2, num_pages=64)
        pids = engine.pipeline.pids
        with pytest.raises(PipelineParallelError, match=said):
            engine.pipeline.load(where, dataclasses.replace(engine.config, model=config_model),
                                 engine.runner.fingerprint())
        engine.close()
        assert all(not Path(f"/proc/{pid}").exists() for pid in pids)


def test_a_hostfile_places_the_stages(tmp_path):
    """mlx.launch's format, this machine first (the last stage), over loopback: the same tokens as one process."""
    model_dir = save_dir(tmp_path / "m", tiny_model(seed=5, num_hidden_layers=4))
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('{"backend": "ring", "envs": ["TINYMLX_TEST_HOSTFILE=1"], "hosts": ['
                        '{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "localhost", "ips": ["127.0.0.1"]}]}')
    arrivals = {0: [(list(range(30)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "r")]}
    want = run_outputs(load_engine(model_dir, num_pages=64), dict(arrivals))["r"].token_ids
    engine = load_engine(model_dir, 2, num_pages=64, hostfile=str(hostfile))
    try:
        assert run_outputs(engine, dict(arrivals))["r"].token_ids == want
        assert [stage.host for stage in engine.stats().pipeline.stages] == ["localhost", "127.0.0.1"]
    finally:
        engine.close()


def test_each_stages_budget_holds_its_own_layers_pages(tmp_path):
    """A KV budget is each machine's: a stage of half the layers keeps half of every page, so the pool has twice
    the pages of one process's, and no stage's share of them passes the budget."""
    model_dir = save_dir(tmp_path / "m", tiny_model(seed=5, num_hidden_layers=4))
    budget = 1 << 20
    one = load_engine(model_dir, kv_cache_bytes=budget).stats()
    engine = load_engine(model_dir, 2, kv_cache_bytes=budget)
    stats = engine.stats()
    engine.close()
    assert stats.num_pages_total == 2 * one.num_pages_total
    assert all(budget / 2 < stage.kv_cache_bytes_budget <= budget for stage in stats.pipeline.stages)


def test_what_pipeline_parallelism_cannot_do_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    model_dir = save_dir(tmp_path / "m", tiny_model(seed=5))  # two layers
    start = time.monotonic()
    with pytest.raises(ValueError, match="2 decoder layers cannot fill 3 pipeline stages"):
        load_engine(model_dir, 3)
    with pytest.raises(ValueError, match="disk_cache_dir is not supported with pipeline parallelism"):
        EngineConfig(pipeline_parallel_size=2, disk_cache_dir=str(tmp_path / "disk"))
    with pytest.raises(ValueError, match="speculative='mtp' is not supported with pipeline parallelism"):
        EngineConfig(pipeline_parallel_size=2, speculative="mtp")
    test_gemma4.hf_checkpoint(tmp_path / "g", test_gemma4.RICH)
    with monkeypatch.context() as patched, pytest.raises(ValueError, match=r"6 decoder layers cannot be split into 3 "
                                                                      r"pipeline stages that keep every KV-shared layer"):
        patched.setattr(PipelineGroup, "__init__", lambda *args: pytest.fail("a worker started"))
        load_engine(tmp_path / "g", 3)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]')
    with pytest.raises(ValueError, match="lists 1 hosts for pipeline_parallel_size=2"):
        load_engine(model_dir, 2, hostfile=str(hostfile))
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 3))  # a count that does not divide
    with pytest.raises(ValueError, match="lists 3 hosts for pipeline_parallel_size=2 x tensor_parallel_size=2"):
        load_engine(model_dir, 2, hostfile=str(hostfile), tensor_parallel_size=2)
    assert time.monotonic() - start < 10


def test_micro_batches_keep_the_batch_order_and_cut_a_long_prompt_only():
    def batch(lengths: list[int]) -> ScheduledBatch:
        chunks = [ScheduledChunk(i, [1] * n, 0, ((0,),), True) for i, n in enumerate(lengths)]
        return ScheduledBatch(chunks, sum(lengths), [])

    def parts(lengths: list[int], most: int) -> list[list[int]]:
        return [[len(c.token_ids) for c in part.chunks] for part in micro_batches(batch(lengths), most)]

    assert parts([1, 1, 1, 1], 2) == [[1, 1], [1, 1]]
    assert parts([1] * 5, 3) == [[1, 1], [1, 1], [1]]
    assert parts([1, 1, 60], 2) == [[1, 1], [60]]
    assert parts([60, 1, 1], 2) == [[60], [1, 1]]
    assert parts([60, 1], 3) == [[30], [30], [1]]  # fewer chunks than parts: the longest cut, no part empty
    assert parts([7], 2) == [[3], [4]]  # a long prompt's pieces follow each other through the stages
    assert parts([1], 3) == [[1]]
    for lengths in ([5, 9, 1, 1, 30, 2], [1] * 17, [40, 40, 40]):
        for most in (1, 2, 3):
            cut = parts(lengths, most)
            assert [n for part in cut for n in part] == lengths and all(cut) and len(cut) == min(most, len(lengths))
    pieces = micro_batches(batch([10]), 2)
    assert [(c.start_position, c.needs_sample) for part in pieces for c in part.chunks] == [(0, False), (5, True)]
    recurrent = batch([10])._replace(chunks=[batch([10]).chunks[0]._replace(state=StateAccess(0, 1))])
    assert len(micro_batches(recurrent, 2)) == 1  # a recurrent state is never cut
