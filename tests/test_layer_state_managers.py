"""One scenario for every kind of layer state (kv/layer_state.py): full attention, a sliding window, a
recurrent state and KV-shared layers, each behind its manager under the KV coordinator. The same workload
allocates, hits a shared prefix, preempts in a pool too small for it, rolls back rejected drafts, saves
to the disk tier and restores in a new engine, and frees everything; `check()` holds after every step,
and every token equals a sequential run without any cache."""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_checkpoints import hf_checkpoint as hybrid_checkpoint
from test_gemma4 import RICH
from test_gemma4 import hf_checkpoint as gemma4_checkpoint
from tiny_models import ByteTokenizer, run_to_completion, tiny_model

from tinymlx import SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.kv.group_blocks import GroupBlocks, SlidingWindowBlocks
from tinymlx.kv.layer_state import SharedKVLayers
from tinymlx.kv.recurrent_states import RecurrentStates
from tinymlx.models import load_model

BS, CHUNK = 4, 16
KINDS = {"full attention": GroupBlocks, "sliding window": SlidingWindowBlocks, "recurrent": RecurrentStates,
         "kv-shared": SharedKVLayers}
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=list(KINDS))
def kind_and_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    if request.param == "full attention":
        return request.param, tiny_model(seed=2, std=0.1)
    if request.param == "sliding window":
        return request.param, tiny_model(seed=2, std=0.1, num_hidden_layers=4, model_type="gemma3_text",
                                         sliding_window=8, sliding_window_pattern=2)
    if request.param == "recurrent":
        hybrid_checkpoint(path, "qwen3_5_text")
    else:
        gemma4_checkpoint(path, RICH)
    return request.param, load_model(path, dtype="float32")


def engine(model, **config) -> Engine:
    return Engine(model, ByteTokenizer(), EngineConfig(block_size=BS, max_num_batched_tokens=CHUNK, max_num_seqs=3,
                                                       **config))


def prompts() -> dict[str, list[int]]:
    """Three prompts sharing a 6-block stem (a prefix hit), each ending in a phrase said twice. The n-gram
    proposer drafts from any earlier occurrence of the last token (min_n=1), which a random model mostly
    rejects: drafts are verified and rolled back."""
    rng = np.random.default_rng(0)
    stem = rng.integers(0, 256, 6 * BS).tolist()
    return {name: stem + rng.integers(0, 256, n).tolist() * 2 for name, n in (("a", 7), ("b", 9), ("c", 6))}


def test_every_kind_allocates_hits_preempts_rolls_back_restores_and_frees(kind_and_model, tmp_path):
    kind, model = kind_and_model
    expected = {name: run_to_completion(engine(model, enable_prefix_caching=False, num_pages=512),
                                        {0: [(prompt, PARAMS, name)]})[name] for name, prompt in prompts().items()}
    probe = engine(model, num_pages=512)
    longest = max(map(len, prompts().values())) + PARAMS.max_tokens
    # One fits with room, three do not; and the pages of two recurrent checkpoints, which share the pool.
    pages = probe.kv_coordinator.peak_blocks(longest, CHUNK) * 3 // 2 + 2 * probe.config.state_slot_pages
    disk = str(tmp_path / "disk")

    under_test = engine(model, num_pages=pages, speculative="ngram:min_n=1,adaptive=0", disk_cache_dir=disk)
    assert any(type(manager) is KINDS[kind] for manager in under_test.kv_coordinator.managers)
    arrivals = {0: [(prompts()["a"], PARAMS, "a")], 1: [(prompts()[n], PARAMS, n) for n in "bc"]}
    assert run_to_completion(under_test, arrivals) == expected  # check() after every step, nothing held at the end
    stats = under_test.stats()
    assert under_test.scheduler.num_preemptions > 0
    assert stats.prefix_hit_rate > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # drafts were proposed, and some rolled back
    under_test.disk_tier.flush()
    under_test.close()

    restarted = engine(model, num_pages=pages, disk_cache_dir=disk)
    assert run_to_completion(restarted, {0: [(prompts()["b"], PARAMS, "b")]}) == {"b": expected["b"]}
    stats = restarted.stats()
    assert stats.disk_cache.num_hits > 0
    assert stats.num_computed_prompt_tokens < len(prompts()["b"])  # resumed from what the disk kept
    assert stats.num_pages_used == 0 and (stats.state_slots is None or stats.state_slots.num_live_used == 0)
