"""The disk tier with a hybrid model's recurrent-state checkpoints, against uncached runs: a new process
resumes an agent's next turn from the checkpoint on disk; a corrupted, truncated or foreign checkpoint
file is deleted with a warning and the hit moves back to the checkpoint before it; within one process a
small pool's lost blocks and checkpoints come back from disk, under preemption too; checkpoints share the
blocks' bound. Tokens and their logprobs are compared (a slightly wrong state may keep the argmax).
Engines are checked after every step (run_to_completion), and no state slot is left held."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_disk_cache import is_whole, worker
from test_hybrid import hf_checkpoint, state_slots
from tiny_models import ByteTokenizer, random_workload, run_outputs, run_to_completion, save_byte_tokenizer

from tinymlx import SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.kv.prefix_cache import chain_hash
from tinymlx.models import Recurrent, load_model

BS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPT = np.random.default_rng(7).integers(0, 256, 102).tolist()  # 25 full blocks before its last token
NEXT_TURN = PROMPT + [5, 80, 13, 44, 200, 9, 61]  # the agent's next turn repeats the prompt
# Checkpoints a whole-prompt chunk keeps: every 16th block, and the prompt's last full one.
CHECKPOINTS = (16, 25)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Callable[[str], Path]:
    """variant -> the directory of its tiny random transformers checkpoint (written once per module)."""
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            path = tmp_path_factory.mktemp(variant) / "m"
            hf_checkpoint(path, variant)
            made[variant] = save_byte_tokenizer(path)
        return made[variant]

    return get


@pytest.fixture(scope="module")
def model(checkpoints):
    return load_model(checkpoints("qwen3_5_text"), dtype="float32")


def engine(model, **config) -> Engine:
    return Engine(model, ByteTokenizer(), EngineConfig(**{"block_size": BS, "num_pages": 256, **config}))


def run(e: Engine, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and their logprobs: a resumed state that is slightly wrong may keep the argmax."""
    out = run_outputs(e, {0: [(prompt, PARAMS, "r")]})["r"]
    return out.token_ids, np.array([t.logprob for t in out.logprobs])


def uncached(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    return run(engine(model, enable_prefix_caching=False), prompt)


def assert_same(got: tuple[list[int], np.ndarray], expected: tuple[list[int], np.ndarray]) -> None:
    assert got[0] == expected[0] and np.abs(got[1] - expected[1]).max() < 1e-4, (got, expected)


def block_hash(prompt: list[int], num_blocks: int) -> int:
    previous = None
    for index in range(num_blocks):
        previous = chain_hash(previous, prompt[index * BS:(index + 1) * BS])
    return previous


def no_state_slot_held(e: Engine) -> None:
    e.check()
    state_slots(e).check([])
    assert e.stats().state_slots.num_live_used == 0


# -- across processes ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["qwen3_5_text", "qwen3_next"])
def test_a_new_process_resumes_the_next_turn_from_the_checkpoint_on_disk(checkpoints, tmp_path, variant):
    model_dir = checkpoints(variant)
    model = load_model(model_dir, dtype="float32")
    spec = {"model": str(model_dir), "disk_cache_dir": str(tmp_path / "disk"), "max_tokens": 8}
    first = worker({**spec, "prompts": [PROMPT]})
    second = worker({**spec, "prompts": [NEXT_TURN]})
    assert first["tokens"] == [uncached(model, PROMPT)[0]] and second["tokens"] == [uncached(model, NEXT_TURN)[0]]
    assert first["disk"]["num_files_written"] == len(PROMPT) // BS + len(CHECKPOINTS)  # the blocks, the states
    # The new process took every block and the deepest checkpoint from disk, and computed only what follows.
    resumed_at = CHECKPOINTS[-1] * BS
    assert second["disk"]["num_hits"] == CHECKPOINTS[-1] and second["disk"]["num_checkpoint_hits"] == 1
    assert second["num_cached_tokens"] == [resumed_at]
    assert second["num_computed_prompt_tokens"] == len(NEXT_TURN) - resumed_at
    assert second["state_slots"]["num_resumed"] == 1 and second["state_slots"]["num_live_used"] == 0
    assert second["disk"]["num_bad_files"] == 0


# -- bad files -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("damage", "reason"), [("corrupted", "checksum mismatch"), ("truncated", "checksum mismatch"),
                                                ("a block's file", "another layout")])
def test_a_bad_checkpoint_is_deleted_and_the_hit_moves_back(model, tmp_path, caplog, damage, reason):
    """Chunks of 48 tokens keep checkpoints at blocks 12 and 24 too: the hit moves back one block, close
    enough that a wrong state would change the tokens."""
    writer = engine(model, max_num_batched_tokens=48, disk_cache_dir=str(tmp_path))
    run(writer, PROMPT)
    writer.close()
    victim = engine(model, disk_cache_dir=str(tmp_path))
    deepest = block_hash(PROMPT, CHECKPOINTS[-1])
    bad = victim.disk_tier.store.path(victim.disk_tier.checkpoints[0].key(deepest))
    data = bad.read_bytes()
    if damage == "corrupted":
        bad.write_bytes(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0x10]) + data[len(data) // 2 + 1:])
    elif damage == "truncated":
        bad.write_bytes(data[:len(data) // 2])
    else:  # whole and checksummed, but the block's K/V under the state's name
        shutil.copy(victim.disk_tier.store.path(victim.disk_tier.key(deepest)), bad)
    with caplog.at_level(logging.WARNING, logger="tinymlx.kv.disk.tier"):
        assert_same(run(victim, PROMPT), uncached(model, PROMPT))
    assert any(bad.name in r.message and reason in r.message for r in caplog.records), caplog.text
    disk = victim.stats().disk_cache
    # Resumed at the checkpoint before it, with the blocks up to there from disk.
    assert disk.num_bad_files == 1 and disk.num_checkpoint_hits == 1 and disk.num_hits == 24
    assert victim.num_computed_prompt_tokens == len(PROMPT) - 24 * BS
    no_state_slot_held(victim)
    victim.disk_tier.flush()
    assert is_whole(bad)  # recomputed, then saved again


# -- within one process ----------------------------------------------------------------------------
def test_blocks_and_checkpoints_memory_lost_come_back_from_disk(model, tmp_path):
    """A pool of 40 blocks and 2 checkpoint slots: two other prompts take both, so the prompt's next turn
    finds its blocks and its deepest checkpoint only on disk."""
    cached = engine(model, num_pages=40, num_state_checkpoints=2, disk_cache_dir=str(tmp_path))
    others = [np.random.default_rng(i).integers(0, 256, 90).tolist() for i in (1, 2)]
    for prompt in (PROMPT, *others):
        assert_same(run(cached, prompt), uncached(model, prompt))
    states = state_slots(cached)
    assert not states.has_checkpoint(block_hash(PROMPT, CHECKPOINTS[-1]))
    assert cached.kv_coordinator.cached_page(0, block_hash(PROMPT, 1), tuple(PROMPT[:BS])) is None
    cached.disk_tier.flush()
    before = cached.num_computed_prompt_tokens
    assert_same(run(cached, NEXT_TURN), uncached(model, NEXT_TURN))
    assert cached.num_computed_prompt_tokens - before == len(NEXT_TURN) - CHECKPOINTS[-1] * BS
    assert cached.stats().disk_cache.num_checkpoint_hits == 1
    no_state_slot_held(cached)


def test_batching_preemption_and_eviction_with_checkpoints_on_disk_change_no_token(model, tmp_path):
    """Blocks and checkpoints restored in the same steps as preemptions and other sequences' chunks."""
    workload = lambda: random_workload(12, seed=4, max_arrival=4)  # noqa: E731
    expected = run_to_completion(engine(model, enable_prefix_caching=False), workload())
    config = dict(num_pages=36, max_num_batched_tokens=24, num_state_checkpoints=3, disk_cache_dir=str(tmp_path))
    cached = engine(model, **config)
    assert run_to_completion(cached, workload()) == expected
    cached.disk_tier.flush()
    assert run_to_completion(cached, workload()) == expected  # hits in memory and on disk, mixed
    assert cached.scheduler.num_preemptions > 0 and cached.stats().disk_cache.num_checkpoint_hits > 0
    no_state_slot_held(cached)
    cached.close()
    restarted = engine(model, **config)
    assert run_to_completion(restarted, workload()) == expected
    assert restarted.stats().disk_cache.num_checkpoint_hits > 0
    no_state_slot_held(restarted)


def test_the_checkpoints_share_the_blocks_bound(model, tmp_path):
    capacity = 40_000  # a few prompts' blocks and checkpoints (a checkpoint here is 5 KiB, a block 0.6 KiB)
    cached = engine(model, num_pages=64, num_state_checkpoints=2, disk_cache_dir=str(tmp_path),
                    disk_cache_gb=capacity / (1 << 30))
    for seed in range(6):
        prompt = np.random.default_rng(seed).integers(0, 256, 70).tolist()
        assert_same(run(cached, prompt), uncached(model, prompt))
        cached.disk_tier.flush()
        assert sum(path.stat().st_size for path in tmp_path.iterdir()) <= capacity
    assert cached.stats().disk_cache.num_files_written * 600 > capacity  # far more than it keeps
    no_state_slot_held(cached)


def test_the_fingerprint_covers_the_recurrent_state(model, tmp_path):
    tier = engine(model, disk_cache_dir=str(tmp_path)).disk_tier
    layer, spec = next((i, s) for i, s in enumerate(model.layer_specs()) if isinstance(s, Recurrent))
    assert f"{layer}:conv[{spec.kernel - 1},{spec.conv_dim}]" in tier.checkpoints[0].layout
    assert tier.checkpoints[0].key(1) != tier.key(1)  # a sibling file, never the block's
