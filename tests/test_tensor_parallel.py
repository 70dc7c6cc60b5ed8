"""Tensor parallelism: 2 ranks over MLX's ring backend on loopback, against the single-process engine.

The worker ranks of this test process start once and are reused by every engine below (MLX keeps one
distributed group per process); scenarios that kill a rank run in their own process (tp_scenarios.py).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_models import (
    ByteTokenizer,
    random_workload,
    run_to_completion,
    save_byte_tokenizer,
    save_dir,
    tiny_model,
)

from tinymlx import LLM, Engine, EngineConfig, SamplingParams
from tinymlx.core.batch import ScheduledBatch, ScheduledChunk
from tinymlx.models import load_model
from tinymlx.models.sharding import AllReduceLinear
from tinymlx.parallel import RankGroup, TensorParallelError

TP = 2
SCENARIOS = Path(__file__).with_name("tp_scenarios.py")


def load_engine(model_dir: Path, tensor_parallel_size: int = 1, **config) -> Engine:
    config.setdefault("block_size", 4)
    config.setdefault("num_pages", 64)
    config = EngineConfig(tensor_parallel_size=tensor_parallel_size, **config)
    return Engine.load(model_dir, ByteTokenizer(), config, "tiny")


def mixed_batches(num_kv_groups: int, block_size: int = 4) -> list[ScheduledBatch]:
    """Three steps: prefills that sample nothing, then a decode beside a mid-prompt chunk, a last chunk
    and a whole prompt, then a last chunk reading K/V from both earlier steps. Block tables scattered
    (every KV group's the same)."""
    rng = np.random.default_rng(0)
    seqs = {i: rng.integers(0, 256, n).tolist() for i, n in enumerate([11, 30, 19, 6])}
    tables = {0: [5, 9, 2], 1: [40, 41, 7, 8, 60, 61, 62, 63], 2: [30, 31, 32, 33, 34], 3: [50, 51]}
    tables = {seq_id: (tuple(table),) * num_kv_groups for seq_id, table in tables.items()}
    steps = [
        [ScheduledChunk(0, seqs[0][:10], 0, tables[0], False), ScheduledChunk(1, seqs[1][:10], 0, tables[1], False),
         ScheduledChunk(2, seqs[2][:12], 0, tables[2], False)],
        [ScheduledChunk(1, seqs[1][10:20], 10, tables[1], False), ScheduledChunk(0, seqs[0][10:11], 10, tables[0], True),
         ScheduledChunk(2, seqs[2][12:19], 12, tables[2], True), ScheduledChunk(3, seqs[3], 0, tables[3], True)],
        [ScheduledChunk(1, seqs[1][20:], 20, tables[1], True)],
    ]
    return [ScheduledBatch(chunks, sum(len(c.token_ids) for c in chunks), []) for chunks in steps]


def num_elements(module: nn.Module) -> int:
    return sum(array.size for _, array in tree_flatten(module.parameters()))


VARIANTS = {  # name: (tiny_model overrides, dtype, MLX-quantize the checkpoint)
    "qwen2": ({}, "float32", False),
    "llama": ({"model_type": "llama"}, "float32", False),
    "tied-embeddings": ({"tie_word_embeddings": True}, "float32", False),
    "q8": ({"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}, "q8", False),
    "tied-q8": ({"hidden_size": 128, "intermediate_size": 256, "head_dim": 32, "tie_word_embeddings": True}, "q8", False),
    "mlx-q4-checkpoint": ({"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}, "auto", True),
    "qwen3": ({"model_type": "qwen3"}, "float32", False),
    "qwen3_moe": ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "norm_topk_prob": True, "mlp_only_layers": [1]}, "float32", False),
    "qwen3_moe-q8": ({"model_type": "qwen3_moe", "hidden_size": 128, "head_dim": 32, "num_experts": 4,
                      "num_experts_per_tok": 2, "moe_intermediate_size": 128}, "q8", False),
    "gemma3_text": ({"model_type": "gemma3_text", "sliding_window": 6, "sliding_window_pattern": 2}, "float32", False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_forward_equals_single_process(tmp_path, variant):
    overrides, dtype, quantized_checkpoint = VARIANTS[variant]
    model = tiny_model(seed=3, **overrides)
    extra = None
    if quantized_checkpoint:
        nn.quantize(model, group_size=64, bits=4)
        extra = {"quantization": {"group_size": 64, "bits": 4}}
    model_dir = save_dir(tmp_path / "m", model, extra)
    single = load_engine(model_dir, dtype=dtype)
    sharded = load_engine(model_dir, TP, dtype=dtype)
    try:
        args, rank0 = model.args, sharded.runner.model
        attn = rank0.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (args.num_attention_heads // TP, args.num_key_value_heads // TP)
        assert isinstance(attn.o_proj, AllReduceLinear)
        for layer in rank0.model.layers:  # dense MLPs reduce after down_proj; an MoE block after its weighted sum
            assert isinstance(layer.mlp.down_proj, AllReduceLinear) if "down_proj" in layer.mlp else layer.mlp._all_reduce
        if not args.tie_word_embeddings:  # this rank's half of the vocabulary, in any layout or dtype
            assert num_elements(rank0.lm_head) * TP == num_elements(single.runner.model.lm_head)
        assert sharded.runner.kv_cache.pools[0][0].shape[0] == args.num_key_value_heads // TP  # this rank's heads only
        itemsize = sharded.runner.kv_cache.layout.dtype.size
        collectives = sharded.runner.ranks.collectives
        for batch in mixed_batches(len(single.runner.kv_groups)):
            expected = single.runner.run(batch)
            before = collectives.counts
            logits = sharded.runner.run(batch)
            assert logits.shape == expected.shape
            assert np.abs(np.array(logits) - np.array(expected)).max(initial=0) < 1e-4
            # The design's communication, from the shapes: two all-reduces of [tokens, hidden] per layer,
            # but the last layer's MLP runs on the sampled rows alone (when any samples); one
            # all-gather of each rank's vocabulary slice of the sampled rows' logits (none when nothing
            # samples); the embedding is whole on every rank; two broadcasts (header, inputs).
            step = collectives.counts - before
            num_sampled = len(batch.sampled_chunks)
            num_sampled_rows = sum(chunk.num_logits for chunk in batch.sampled_chunks)
            last_mlp_rows = num_sampled_rows or batch.num_batched_tokens
            reduced_rows = (2 * args.num_hidden_layers - 1) * batch.num_batched_tokens + last_mlp_rows
            assert step.num_all_reduces == 2 * args.num_hidden_layers
            assert step.all_reduce_bytes == reduced_rows * args.hidden_size * itemsize
            assert step.num_all_gathers == (1 if num_sampled else 0)
            assert step.all_gather_bytes == num_sampled * args.vocab_size // TP * itemsize
            assert step.num_broadcasts == 2
    finally:
        sharded.close()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_byte_tokenizer(save_dir(tmp_path_factory.mktemp("tiny") / "m", tiny_model(seed=5)))


def test_engine_output_equals_single_rank_through_prefix_hits_and_preemption(tiny_dir):
    """Greedy and seeded sampling; a pool small enough to preempt; shared prompts hit the prefix cache."""
    workload = dict(n=16, seed=2, max_arrival=3, seeded_sampling=True)
    shared = [7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # every prompt starts with these 3 blocks
    arrivals = random_workload(**workload)
    for items in arrivals.values():
        for i, (prompt, params, request_id) in enumerate(items):
            items[i] = (shared + prompt, params, request_id)
    reference = run_to_completion(load_engine(tiny_dir, num_pages=40, max_num_batched_tokens=64),
                                  {k: list(v) for k, v in arrivals.items()})
    engine = load_engine(tiny_dir, TP, num_pages=40, max_num_batched_tokens=64)
    try:
        assert run_to_completion(engine, arrivals) == reference
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_hit_rate > 0.1
        assert stats.tensor_parallel_size == TP and stats.comm_total.num_all_reduces > 0
    finally:
        engine.close()


def test_int8_kv_engine_output_equals_single_rank(tmp_path):
    """Each rank quantizes its own KV heads' K/V into its int8 pool: the same tokens as one rank's int8 pool."""
    model_dir = save_byte_tokenizer(save_dir(tmp_path / "m", tiny_model(seed=5, head_dim=32)))
    arrivals = random_workload(n=10, seed=3, max_arrival=3, seeded_sampling=True)
    reference = run_to_completion(load_engine(model_dir, kv_cache_dtype="int8"), {k: list(v) for k, v in arrivals.items()})
    engine = load_engine(model_dir, TP, kv_cache_dtype="int8")
    try:
        assert engine.runner.kv_cache.layout.is_quantized
        assert run_to_completion(engine, arrivals) == reference
    finally:
        engine.close()


def test_llm_api_and_group_reuse(tiny_dir):
    """LLM(tensor_parallel_size=2) over the same ranks, one engine after another; a second live engine is refused."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = LLM(str(tiny_dir), block_size=4, num_pages=64, progress=False).generate("hello", params)[0].token_ids
    with LLM(str(tiny_dir), block_size=4, num_pages=64, tensor_parallel_size=TP, progress=False) as llm:
        assert llm.generate("hello", params)[0].token_ids == expected
        pids = RankGroup._current.pids
        with pytest.raises(TensorParallelError, match="another engine"):
            LLM(str(tiny_dir), tensor_parallel_size=TP, progress=False)
    with LLM(str(tiny_dir), block_size=4, num_pages=64, tensor_parallel_size=TP, progress=False) as llm:
        assert llm.generate("hello", params)[0].token_ids == expected
        assert RankGroup._current.pids == pids  # the same worker processes
    with pytest.raises(RuntimeError, match="this engine is closed"):  # close() gave the ranks and the model back
        llm.generate("hello", params)


def test_ranks_sharing_the_machine_limit_every_blas_to_their_share_of_its_cores(tiny_dir):
    """MLX's OpenBLAS and numpy's own (the CPU's one-row linears call it) alike: left at every core, numpy's
    threads spun against the worker's (a 0.5B decode step at TP=2 took 6.6x TP=1's)."""
    from threadpoolctl import threadpool_info

    def blas_threads() -> set[int]:
        return {info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"}

    before = blas_threads()
    with LLM(str(tiny_dir), block_size=4, num_pages=64, tensor_parallel_size=TP, progress=False):
        assert len(threadpool_info()) >= 2 and blas_threads() == {max(1, os.cpu_count() // TP)}
    assert blas_threads() == before


def test_a_rank_that_cannot_load_fails_the_load_and_the_ranks_serve_on(tiny_dir, tmp_path):
    """Every rank builds, then all agree: a worker that failed (here: no model at the path it was
    given) or rank 0 failing makes the load raise on rank 0, with the worker's own error."""
    config = EngineConfig(block_size=4, num_pages=64, tensor_parallel_size=TP, model=str(tmp_path / "absent"))
    ranks = RankGroup.acquire(TP)

    def build() -> Engine:  # rank 0 itself loads the real model
        return Engine(load_model(tiny_dir, shard=ranks.collectives), ByteTokenizer(), config, ranks=ranks)

    with pytest.raises(TensorParallelError, match="(?s)rank 1:.*ModelLoadError.*absent"):
        ranks.load(tmp_path / "absent", config, build, lambda engine: engine.runner)

    def fail() -> Engine:
        raise RuntimeError("rank 0 could not build")

    ranks = RankGroup.acquire(TP)
    with pytest.raises(RuntimeError, match="rank 0 could not build"):
        ranks.load(tiny_dir, config, fail, lambda engine: engine.runner)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_dir), tensor_parallel_size=TP, num_pages=64, progress=False) as llm:
        assert len(llm.generate("still serving", params)[0].token_ids) == 4


@pytest.mark.parametrize(("overrides", "size", "message"), [
    ({}, 3, "tensor_parallel_size=3 cannot split.*4 attention heads and 2 KV heads"),
    ({}, 4, "2 KV heads"),
    ({"intermediate_size": 129}, 2, "FFN width of 129"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 33}, 2,
     r"FFN width of 33 \(experts' down_proj\)"),
])
def test_model_that_does_not_split_fails_before_any_rank_starts(tmp_path, overrides, size, message):
    model_dir = save_dir(tmp_path / "m", tiny_model(**overrides))
    before = RankGroup._current
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        load_engine(model_dir, size)
    assert time.monotonic() - start < 2 and RankGroup._current is before


def test_quantized_shards_must_hold_whole_groups(tmp_path):
    model_dir = save_dir(tmp_path / "m", tiny_model())  # o_proj: 64 inputs, 32 per rank < a q8 group of 64
    with pytest.raises(ValueError, match="o_proj's 32 input features per rank, not a multiple of .* 64"):
        load_engine(model_dir, TP, dtype="q8")


def test_tensor_parallel_size_is_never_ignored():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs the model sharded"):
        Engine(tiny_model(), ByteTokenizer(), EngineConfig(tensor_parallel_size=2, num_pages=16))
    with pytest.raises(ValueError, match="hostfile places parallel ranks"):
        EngineConfig(hostfile="hosts.json")


BAD_HOSTFILES = [  # content (None: no file), what the error must say
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ("[]", "non-empty list of hosts"),
    ('[{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "mac2.local"}]', 'host 1 .mac2.local. needs "ips"'),
    ('[{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["::1"]}]', "not an IPv4 address"),
    ('{"backend": "mpi", "hosts": []}', "backend 'mpi' is not supported"),
    ('[{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]', "lists 1 hosts for tensor_parallel_size=2"),
]


@pytest.mark.parametrize(("content", "message"), BAD_HOSTFILES)
def test_bad_hostfile_fails_fast_with_a_clear_message(tiny_dir, tmp_path, content, message):
    path = tmp_path / "hosts.json"
    if content is not None:
        path.write_text(content)
    start = time.monotonic()
    with pytest.raises((ValueError, TensorParallelError), match=message):
        LLM(str(tiny_dir), tensor_parallel_size=TP, hostfile=str(path), progress=False)
    assert time.monotonic() - start < 2


def test_a_hostfile_whose_first_host_is_another_machine_fails_fast(tiny_dir, tmp_path, monkeypatch):
    """Rank 0 must be able to listen on the first host's ips. Tests use loopback addresses only, so
    "another machine's address" is a bind this machine refuses, as it refuses any address not its own."""
    def refuse(sock, address):
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")

    monkeypatch.setattr(socket.socket, "bind", refuse)
    path = tmp_path / "hosts.json"
    path.write_text('[{"ssh": "mac1.local", "ips": ["127.0.0.1"]}, {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]')
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="first host of the hostfile must be this machine"):
        LLM(str(tiny_dir), tensor_parallel_size=TP, hostfile=str(path), progress=False)
    assert time.monotonic() - start < 2


def run_scenario(name: str, *args: str, timeout: float = 120) -> dict:
    """Run tp_scenarios.py in its own process (its own ranks); return the JSON it prints last."""
    done = subprocess.run([sys.executable, str(SCENARIOS), name, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=SCENARIOS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent's wait() would remove it.
    status = Path(f"/proc/{pid}/stat")
    return not (status.is_file() and status.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.parametrize("when", ["mid-run", "idle"])
def test_killed_worker_ends_the_run_with_a_clear_error(tiny_dir, when):
    result = run_scenario(f"kill-worker-{when}", str(tiny_dir))
    assert "rank 1" in result["error"] and "killed by signal 9" in result["error"], result["error"]
    assert result["seconds_to_error"] < 2.0  # the bound the README states
    assert not any(is_running(pid) for pid in result["worker_pids"])


def test_a_rank_that_fails_to_start_is_reported_with_its_output(tiny_dir, tmp_path):
    hostfile = tmp_path / "hosts.json"  # a Python that cannot start: the worker exits at once
    hostfile.write_text(json.dumps({"envs": ["PYTHONHOME=/nonexistent"], "hosts": [
        {"ssh": "localhost", "ips": ["127.0.0.1"]}, {"ssh": "localhost", "ips": ["127.0.0.1"]}]}))
    result = run_scenario("start", str(tiny_dir), str(hostfile))
    assert "rank 1" in result["error"] and "failed to start" in result["error"], result["error"]
    assert "nonexistent" in result["error"] or "encodings" in result["error"]  # its own output
    assert result["seconds_to_error"] < 5


def test_workers_die_with_rank_0(tiny_dir):
    """rank 0 killed outright (no atexit, no shutdown): its workers exit too, leaving no orphans."""
    process = subprocess.Popen([sys.executable, str(SCENARIOS), "serve-until-killed", str(tiny_dir)],
                               stdout=subprocess.PIPE, text=True, cwd=SCENARIOS.parent)
    try:
        worker_pids = json.loads(process.stdout.readline())["worker_pids"]
        assert all(is_running(pid) for pid in worker_pids)
        process.kill()
        process.wait()
        deadline = time.monotonic() + 5
        while any(is_running(pid) for pid in worker_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(is_running(pid) for pid in worker_pids)
    finally:
        process.kill()


def test_loopback_hostfile_runs_the_same_code(tiny_dir, tmp_path):
    """A hostfile names the hosts (here two loopback entries; "localhost" is started without ssh)."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "ring", "envs": ["TINYMLX_TEST_ENV=1"], "hosts": [
        {"ssh": "localhost", "ips": ["127.0.0.1"]}, {"ssh": "localhost", "ips": ["127.0.0.1"]}]}))
    result = run_scenario("generate", str(tiny_dir), str(hostfile))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = LLM(str(tiny_dir), block_size=4, num_pages=64, progress=False).generate("hello", params)[0]
    assert result["token_ids"] == expected.token_ids
    assert result["worker_env"] == "1" and result["num_all_reduces"] > 0


def test_cli_takes_tp_and_hostfile(tmp_path):
    from tinymlx.cli import _engine_kwargs, build_parser

    kwargs = _engine_kwargs(build_parser().parse_args(["generate", "hi", "--tp", "2"]))
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["hostfile"] is None
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 2))
    kwargs = _engine_kwargs(build_parser().parse_args(["chat", "--hostfile", str(hostfile)]))
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["hostfile"] == str(hostfile)  # one rank per host
