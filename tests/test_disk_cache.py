"""The prefix cache's disk tier against uncached runs: a second process serves a long prompt from disk with
the same tokens and computes fewer; a corrupted, truncated or foreign file is deleted with a warning and its
block recomputed; the directory keeps its bound, least recently used first and chain tails before heads;
two processes write into one directory at once; a window group restores what memory lost; host copies
round-trip float32, bfloat16 and int8 blocks bit for bit. Engines are checked after every step
(run_to_completion)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_models import (
    ByteTokenizer,
    random_workload,
    run_to_completion,
    save_byte_tokenizer,
    save_dir,
    tiny_engine,
    tiny_model,
)

from tinymlx import SamplingParams
from tinymlx.cli import _engine_kwargs, build_parser, main
from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.kv.disk.block_file import BlockHeader, decode
from tinymlx.kv.disk.store import SUFFIX, DiskStore
from tinymlx.kv.prefix_cache import chain_hash
from tinymlx.server.metrics import ServerMetrics

BS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = list(range(10, 250)) + list(range(20, 120))  # 340 tokens: 84 full blocks before the last one
NUM_LONG_BLOCKS = (len(LONG) - 1) // BS
WORKER = Path(__file__).with_name("disk_cache_worker.py")
GEMMA = dict(model_type="gemma3_text", sliding_window=16, sliding_window_pattern=2, num_hidden_layers=4)


def run(engine: Engine, prompt: list[int], params: SamplingParams = PARAMS) -> list[int]:
    return run_to_completion(engine, {0: [(prompt, params, "r")]})["r"]


def uncached(prompt: list[int], seed: int = 0, **config) -> list[int]:
    return run(tiny_engine(seed, enable_prefix_caching=False, **config), prompt)


def saved(engine: Engine, prompt: list[int]) -> list[int]:
    """Run `prompt`, then wait for its blocks to be on disk and close the engine (a process that exits)."""
    tokens = run(engine, prompt)
    engine.close()
    return tokens


def block_hashes(prompt: list[int]) -> list[int]:
    hashes, previous = [], None
    for index in range((len(prompt) - 1) // BS):
        previous = chain_hash(previous, prompt[index * BS:(index + 1) * BS])
        hashes.append(previous)
    return hashes


def is_whole(path: Path) -> bool:
    """The file passes every check against its own header (checksum, sizes)."""
    data = path.read_bytes()
    header = BlockHeader.from_json(data[16:16 + int.from_bytes(data[12:16], "little")])
    decode(data, header)
    return True


def worker(spec: dict, wait: bool = True):
    process = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], cwd=WORKER.parent,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return result(process) if wait else process


def result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = save_dir(tmp_path_factory.mktemp("model") / "tiny", tiny_model(0))
    return save_byte_tokenizer(path)


# -- across processes ------------------------------------------------------------------------------
def test_a_second_process_serves_a_long_prompt_from_disk(model_dir, tmp_path):
    spec = {"model": str(model_dir), "disk_cache_dir": str(tmp_path / "disk"), "prompts": [LONG], "max_tokens": 8}
    first, second = worker(spec), worker(spec)
    reference = run(Engine.from_config(EngineConfig(model=str(model_dir), block_size=BS, num_pages=256,
                                                    enable_prefix_caching=False), progress=False), LONG)
    assert first["tokens"] == second["tokens"] == [reference]
    assert first["disk"]["num_hits"] == 0 and first["disk"]["num_files_written"] == len(LONG) // BS  # all full ones
    assert second["disk"]["num_hits"] == NUM_LONG_BLOCKS and second["disk"]["num_misses"] == 0  # all it can use
    assert 0 < second["disk"]["num_bytes_read"] < first["disk"]["num_bytes_written"]
    assert first["num_computed_prompt_tokens"] == len(LONG)
    assert second["num_computed_prompt_tokens"] == len(LONG) - NUM_LONG_BLOCKS * BS
    # The keys are content digests: the same in every process, and this one's.
    here = Engine.from_config(EngineConfig(model=str(model_dir), block_size=BS, num_pages=256,
                                           disk_cache_dir=str(tmp_path / "disk")), progress=False)
    assert first["keys"] == second["keys"] == [here.disk_tier.key(h) for h in block_hashes(LONG)]
    assert first["fingerprint"] == second["fingerprint"] == here.disk_tier.fingerprint
    here.close()


def test_two_processes_writing_at_once_never_load_a_corrupt_file(model_dir, tmp_path):
    system = list(range(30, 190))  # a shared prefix both write at the same moment
    prompts = [system + list(range(200 + 7 * i, 240 + 7 * i)) for i in range(4)]
    spec = {"model": str(model_dir), "disk_cache_dir": str(tmp_path / "disk"), "max_tokens": 6,
            "start_at": time.time() + 3.0}
    writers = [worker({**spec, "prompts": prompts[i::2]}, wait=False) for i in range(2)]
    results = [result(process) for process in writers]
    reader = worker({**spec, "prompts": prompts, "start_at": 0})
    reference = Engine.from_config(EngineConfig(model=str(model_dir), block_size=BS, num_pages=256,
                                                enable_prefix_caching=False), progress=False)
    expected = [run(reference, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                for prompt in prompts]
    assert results[0]["tokens"] == expected[0::2] and results[1]["tokens"] == expected[1::2]
    assert reader["tokens"] == expected
    assert all(r["disk"]["num_bad_files"] == 0 and r["disk"]["num_write_errors"] == 0 for r in [*results, reader])
    assert reader["disk"]["num_misses"] == 0 and reader["num_computed_prompt_tokens"] <= 4 * len(prompts)
    files = list((tmp_path / "disk").iterdir())
    assert files and all(path.suffix == SUFFIX and is_whole(path) for path in files)  # no temporary file left


# -- bad files -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("damage", "reason"), [("corrupted", "checksum mismatch"), ("truncated", "checksum mismatch"),
                                                ("another model", "another fingerprint"),
                                                ("not a block file", "not a tinymlx KV block file")])
def test_a_bad_file_is_deleted_with_a_warning_and_its_block_recomputed(tmp_path, caplog, damage, reason):
    saved(tiny_engine(disk_cache_dir=str(tmp_path / "disk")), LONG)
    victim = tiny_engine(disk_cache_dir=str(tmp_path / "disk"))
    bad = victim.disk_tier.store.path(victim.disk_tier.key(block_hashes(LONG)[40]))
    data = bad.read_bytes()
    if damage == "corrupted":
        bad.write_bytes(data[:1000] + bytes([data[1000] ^ 0x10]) + data[1001:])
    elif damage == "truncated":
        bad.write_bytes(data[:len(data) // 2])
    elif damage == "another model":
        other = tiny_engine(seed=1, disk_cache_dir=str(tmp_path / "other"))
        saved(other, LONG)
        shutil.copy(other.disk_tier.store.path(other.disk_tier.key(block_hashes(LONG)[40])), bad)
    else:
        bad.write_bytes(b"not a block at all, but long enough to be read as one")
    with caplog.at_level(logging.WARNING, logger="tinymlx.kv.disk.tier"):
        assert run(victim, LONG) == uncached(LONG)
    assert any(bad.name in r.message and reason in r.message for r in caplog.records), caplog.text
    disk = victim.stats().disk_cache
    assert disk.num_bad_files == 1 and disk.num_hits == 40  # the blocks before it came from disk
    assert victim.num_computed_prompt_tokens == len(LONG) - 40 * BS
    victim.disk_tier.flush()
    assert is_whole(bad)  # recomputed, then saved again


# -- the bound -------------------------------------------------------------------------------------
def _block_file_bytes(tmp_path: Path) -> int:
    probe = tiny_engine(disk_cache_dir=str(tmp_path / "probe"))
    saved(probe, LONG[:41])
    return probe.disk_tier.store.num_bytes // probe.disk_tier.store.num_files


def _bytes_on_disk(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def test_a_full_directory_keeps_its_bound_and_a_chains_head(tmp_path):
    capacity = 30 * _block_file_bytes(tmp_path)
    config = dict(disk_cache_dir=str(tmp_path / "disk"), disk_cache_gb=capacity / (1 << 30))
    others = [[t + 100 for t in LONG[i:i + 81]] for i in range(0, 120, 40)]  # 20 blocks each: the bound is reached
    for prompt in others:
        saved(tiny_engine(**config), prompt)
        assert _bytes_on_disk(tmp_path / "disk") <= capacity
    assert tiny_engine(**config).disk_tier.store.num_bytes > capacity - _block_file_bytes(tmp_path)  # it is full
    # A prompt longer than the bound: its tail goes first, so what stays is a prefix a restart can hit.
    assert saved(tiny_engine(**config), LONG) == uncached(LONG)
    assert _bytes_on_disk(tmp_path / "disk") <= capacity
    restarted = tiny_engine(**config)
    assert run(restarted, LONG) == uncached(LONG)
    kept = restarted.stats().disk_cache.num_hits
    assert 25 <= kept <= 30 and restarted.num_computed_prompt_tokens == len(LONG) - kept * BS
    restarted.disk_tier.flush()
    assert _bytes_on_disk(tmp_path / "disk") <= capacity


def test_the_bound_holds_after_many_writes(tmp_path):
    capacity = 50 * _block_file_bytes(tmp_path)
    engine = tiny_engine(disk_cache_dir=str(tmp_path / "disk"), disk_cache_gb=capacity / (1 << 30), num_pages=64)
    rng = np.random.default_rng(0)
    for _ in range(12):
        run(engine, rng.integers(0, 256, int(rng.integers(20, 120))).tolist())
        engine.disk_tier.flush()
        assert engine.disk_tier.store.num_bytes <= capacity and _bytes_on_disk(tmp_path / "disk") <= capacity
    assert engine.stats().disk_cache.num_files_written > 100  # far more than it keeps


def test_the_store_evicts_the_least_recently_used_and_a_rescan_keeps_the_order(tmp_path):
    store = DiskStore(tmp_path, capacity_bytes=300)
    for n, key in enumerate("abc"):
        store.write(key * 32, [b"x" * 100], mtime_ns=10 + n)
    store.touch("a" * 32, mtime_ns=20)  # used again: now the newest
    store.write("d" * 32, [b"y" * 100], mtime_ns=30)
    assert store.keys() == ["c" * 32, "a" * 32, "d" * 32] and store.num_bytes == 300  # b went
    assert not store.path("b" * 32).exists()
    assert DiskStore(tmp_path, capacity_bytes=300).keys() == store.keys()  # another process's view
    assert DiskStore(tmp_path, capacity_bytes=200).keys() == ["a" * 32, "d" * 32]  # a smaller bound evicts at start
    assert store.read("c" * 32) is None and "c" * 32 not in store  # gone under another process: forgotten
    (tmp_path / "notes.txt").write_text("mine")
    assert store.clear() == 200 and (tmp_path / "notes.txt").exists()  # only block files go


# -- what is saved, and when -----------------------------------------------------------------------
def test_blocks_evicted_from_memory_are_saved_with_the_reply(tmp_path):
    config = dict(disk_cache_dir=str(tmp_path / "disk"), num_pages=24)
    engine = tiny_engine(**config)
    first = list(range(40, 70))
    reply = run(engine, first, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    run(engine, list(range(100, 180)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # evicts it
    engine.close()
    turn_two = first + reply + [7]
    restarted = tiny_engine(**config)
    assert run(restarted, turn_two) == uncached(turn_two)
    assert restarted.stats().disk_cache.num_hits == (len(first) + len(reply) - 1) // BS  # the reply's blocks too


def test_batching_preemption_and_eviction_with_the_disk_tier_change_no_token(tmp_path):
    """A small pool: blocks are evicted (and saved) and restored in the same steps as preemptions."""
    workload = lambda: random_workload(24, seed=1, max_arrival=6)  # noqa: E731
    expected = run_to_completion(tiny_engine(enable_prefix_caching=False), workload())
    config = dict(num_pages=24, max_num_batched_tokens=64, disk_cache_dir=str(tmp_path))
    engine = tiny_engine(**config)
    assert run_to_completion(engine, workload()) == expected
    engine.disk_tier.flush()
    assert run_to_completion(engine, workload()) == expected  # hits in memory and on disk, mixed
    assert engine.scheduler.num_preemptions > 0 and engine.stats().disk_cache.num_hits > 0
    engine.close()
    restarted = tiny_engine(**config)
    assert run_to_completion(restarted, workload()) == expected
    assert restarted.stats().disk_cache.num_misses == 0


def test_a_full_writer_queue_drops_writes_and_never_waits(tmp_path, monkeypatch):
    release = threading.Event()
    write = DiskStore.write
    monkeypatch.setattr(DiskStore, "write", lambda *args: release.wait(30) and write(*args))  # a stuck disk
    engine = tiny_engine(disk_cache_dir=str(tmp_path / "disk"))
    engine.disk_tier.writer.max_pending_bytes = 10 * engine.disk_tier.block_nbytes
    started = time.monotonic()
    assert run(engine, LONG) == uncached(LONG)
    assert time.monotonic() - started < 20 and not release.is_set()  # the steps never waited for the disk
    assert engine.stats().disk_cache.num_writes_dropped == len(LONG) // BS - 10
    release.set()
    engine.close()
    restarted = tiny_engine(disk_cache_dir=str(tmp_path / "disk"))
    assert run(restarted, LONG) == uncached(LONG) and restarted.stats().disk_cache.num_hits == 10  # the head


# -- layouts and layer kinds -----------------------------------------------------------------------
@pytest.mark.parametrize(("kv_cache_dtype", "dtype"), [("auto", mx.float32), ("auto", mx.bfloat16),
                                                        ("int8", mx.float32)])
def test_blocks_round_trip_bit_for_bit(tmp_path, kv_cache_dtype, dtype):
    def engine(**config):
        model = tiny_model(0, head_dim=32)  # int8 groups of 32
        model.set_dtype(dtype)
        return Engine(model, ByteTokenizer(), EngineConfig(block_size=BS, num_pages=256, kv_cache_dtype=kv_cache_dtype,
                                                           **config))

    def blocks(e: Engine) -> list[list[np.ndarray]]:
        ids = [e.kv_coordinator.cached_page(0, h, tuple(LONG[i * BS:(i + 1) * BS]))
               for i, h in enumerate(block_hashes(LONG))]
        return [e.runner.kv_cache.read_blocks(layer, ids) for layer in range(2)]

    first = engine(disk_cache_dir=str(tmp_path))
    tokens = run(first, LONG)
    written = blocks(first)
    first.close()
    restarted = engine(disk_cache_dir=str(tmp_path))
    assert run(restarted, LONG) == tokens == run(engine(enable_prefix_caching=False), LONG)
    assert restarted.stats().disk_cache.num_hits == NUM_LONG_BLOCKS
    for before, after in zip(written, blocks(restarted)):
        assert all(a.dtype == b.dtype and (a == b).all() for a, b in zip(before, after))
    if kv_cache_dtype == "int8":
        assert written[0][0].dtype == np.uint32 and len(written[0]) == 6  # codes, scales, biases of K and V


def test_a_window_group_restores_the_blocks_memory_lost(tmp_path):
    """Gemma-style layers: the window group's small pool loses a prompt's blocks while the full group keeps
    them; the next hit takes the full group's from memory and the window's from disk."""
    model = tiny_model(seed=2, std=0.02, **GEMMA)

    def engine(**config) -> Engine:
        return Engine(model, ByteTokenizer(), EngineConfig(block_size=BS, num_pages=96, max_num_batched_tokens=24,
                                                           max_num_seqs=1, **config))

    prompt, other = list(range(30, 150)), list(range(150, 250))
    expected = {tuple(p): run(engine(enable_prefix_caching=False), p) for p in (prompt, other)}
    cached = engine(disk_cache_dir=str(tmp_path))
    assert [run(cached, p) for p in (prompt, other)] == [expected[tuple(prompt)], expected[tuple(other)]]
    hits_before = cached.stats().disk_cache.num_hits
    assert run(cached, prompt) == expected[tuple(prompt)]
    restored = cached.stats().disk_cache.num_hits - hits_before
    assert sorted(group.window or 0 for group in cached.kv_coordinator.groups) == [0, 16]
    assert 0 < restored <= 5  # the window's last blocks only: the full group's came from memory
    assert cached.num_computed_prompt_tokens == 2 * len(prompt) + len(other) - (len(prompt) - 1) // BS * BS
    cached.close()
    restarted = engine(disk_cache_dir=str(tmp_path))
    assert run(restarted, prompt) == expected[tuple(prompt)]
    assert restarted.stats().disk_cache.num_hits == (len(prompt) - 1) // BS  # every group's blocks from disk


def test_what_cannot_keep_blocks_on_disk_is_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="disk_cache_dir is not supported with tensor parallelism"):
        EngineConfig(disk_cache_dir=str(tmp_path), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="disk_cache_dir.*enable_prefix_caching=True"):
        EngineConfig(disk_cache_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="disk_cache_gb bounds"):
        EngineConfig(disk_cache_gb=1)
    # Hybrid models are not refused: their checkpoints go to disk beside the blocks (test_disk_cache_hybrid.py).
    hybrid = tiny_model(model_type="qwen3_5_text", num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
    engine = Engine(hybrid, ByteTokenizer(), EngineConfig(block_size=BS, num_pages=64, disk_cache_dir=str(tmp_path)))
    assert engine.disk_tier.checkpoints
    engine.close()


# -- accounting, the command line ------------------------------------------------------------------
def test_stats_count_weights_kv_bytes_in_use_and_the_disk_tier(tmp_path):
    engine = tiny_engine(disk_cache_dir=str(tmp_path), num_pages=64)
    engine.add_request(LONG[:100], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    args = engine.runner.model.args
    block_bytes = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * BS * 4  # K and V, float32
    assert stats.kv_cache_bytes_used == stats.num_pages_used * block_bytes > 0
    assert stats.weights_bytes == sum(p.nbytes for _, p in tree_flatten(engine.runner.model.parameters())) > 0
    run_to_completion(engine, {})
    engine.disk_tier.flush()
    disk = engine.stats().disk_cache
    assert disk.directory == str(tmp_path) and disk.num_files == disk.num_files_written == 100 // BS
    assert disk.num_bytes == disk.num_bytes_written == _bytes_on_disk(tmp_path)
    metrics = ServerMetrics(engine.stats).exposition().decode()
    for line in (f'tinymlx_memory_bytes{{kind="weights"}} {float(stats.weights_bytes)}',
                 f'tinymlx_memory_bytes{{kind="kv_cache_budget"}} {float(64 * block_bytes)}',
                 'tinymlx_disk_cache_lookups_total{result="miss"} 24.0',
                 f"tinymlx_disk_cache_written_bytes_total {float(disk.num_bytes_written)}",
                 f"tinymlx_disk_cache_bytes {float(disk.num_bytes)}"):
        assert line in metrics, line
    engine.set_disk_cache(False)
    assert not engine.stats().disk_cache.is_enabled and not engine.disk_tier.holds(block_hashes(LONG)[0])
    engine.close()


def test_chat_keeps_a_disk_cache_by_default_and_the_flags_set_or_drop_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    chat = _engine_kwargs(build_parser().parse_args(["chat"]))
    assert chat["disk_cache_dir"] == str(tmp_path / "cache" / "prefix-cache") and chat["disk_cache_gb"] == 2.0
    assert _engine_kwargs(build_parser().parse_args(["chat", "--no-disk-cache"]))["disk_cache_dir"] is None
    assert _engine_kwargs(build_parser().parse_args(["serve"]))["disk_cache_dir"] is None
    served = _engine_kwargs(build_parser().parse_args(["serve", "--disk-cache", "d", "--disk-cache-gb", "0.5"]))
    assert (served["disk_cache_dir"], served["disk_cache_gb"]) == ("d", 0.5)
    with pytest.raises(ValueError, match="--disk-cache DIR"):
        _engine_kwargs(build_parser().parse_args(["generate", "hi", "--disk-cache-gb", "1"]))
    saved(tiny_engine(disk_cache_dir=chat["disk_cache_dir"]), LONG[:41])
    main(["disk-cache"])
    assert "10 blocks" in capsys.readouterr().out
    main(["disk-cache", "clear"])
    assert "freed" in capsys.readouterr().out and not list((tmp_path / "cache" / "prefix-cache").iterdir())


def test_the_fingerprint_is_the_same_whichever_layout_the_cpu_linears_chose(tmp_path, monkeypatch):
    """Each process times its linears' layout at load (ops/cpu/linear.py): two that chose differently must
    still find each other's blocks (a 4,000-token resume found none when they did)."""
    from tinymlx.kv.disk.fingerprint import model_fingerprint
    from tinymlx.models import load_model
    from tinymlx.ops.cpu.linear import LINEAR_LAYOUT_ENV

    model_dir = save_dir(tmp_path / "m", tiny_model(seed=2))
    fingerprints = set()
    for layout in ("input_major", "hf"):
        monkeypatch.setenv(LINEAR_LAYOUT_ENV, layout)
        model = load_model(model_dir, "float32")
        names = {name for name, _ in tree_flatten(model.parameters())}
        assert any(name.endswith("weight_t") for name in names) == (layout == "input_major")
        engine = Engine(model, ByteTokenizer(), EngineConfig(num_pages=16))
        fingerprints.add(model_fingerprint(model, engine.runner.kv_cache.layout, 16))
    assert len(fingerprints) == 1
