"""The one table of pairings the engine does not do yet (core/refusals.py): each row fires for exactly its
pairing, with its message, and a plain full-attention model pairs with every feature."""

from __future__ import annotations

import pytest

from tinymlx.core import refusals
from tinymlx.core.config import EngineConfig
from tinymlx.core.layer_specs import FullAttention, Recurrent, SharedKV, SlidingWindow
from tinymlx.core.refusals import DraftFacts

FULL, WINDOW, RECURRENT = FullAttention(), SlidingWindow(8), Recurrent(4, 16, 2, 8, 8)
DRAFT = {"speculative": "draft:d"}
# config fields, the target's layer kinds, what the proposer's model is -> the row expected
CASES = {
    "draft model/draft sliding-window layers": (DRAFT, (FULL,), DraftFacts((FULL, WINDOW))),
    "draft model/no full-attention layers": (DRAFT, (WINDOW,), DraftFacts((FULL,))),
    "draft model/draft recurrent layers": (DRAFT, (FULL, RECURRENT), DraftFacts((RECURRENT, FULL))),
    "draft model/no draft model": (DRAFT, (FULL,), DraftFacts(is_loaded=False)),
    "draft model/another tokenizer": (DRAFT, None, DraftFacts(same_tokenizer=False)),
    "draft model/a larger draft vocabulary": (DRAFT, (FULL,), DraftFacts((FULL,), vocab_size=512, target_vocab_size=300)),
    "MTP head/no MTP head": ({"speculative": "mtp"}, (FULL, RECURRENT), DraftFacts(is_loaded=False)),
    "a step budget below a block/recurrent layers": ({"max_num_batched_tokens": 8, "block_size": 16},
                                                     (RECURRENT, FULL), None),
    "KV-shared layers/a shared source without K/V": ({}, (FULL, RECURRENT, SharedKV(1)), None),
}


def test_every_row_has_a_case():
    config_only = {"disk tier/tensor parallelism", "MTP head/tensor parallelism"}  # test_mtp.py, test_disk_cache.py
    config_only |= {"disk tier/pipeline parallelism", "MTP head/pipeline parallelism",  # and what the model's family
                    "pipeline parallelism/a family that cannot split"}  # cannot do: test_pipeline_parallel.py
    assert {f"{r.feature}/{r.paired_with}" for r in refusals.REFUSALS} == set(CASES) | config_only


@pytest.mark.parametrize("pairing", list(CASES))
def test_each_row_refuses_its_pairing_with_its_message(pairing):
    fields, specs, draft = CASES[pairing]
    config = EngineConfig(**fields)  # the config alone pairs with no layer kind: it is accepted
    row = next(r for r in refusals.REFUSALS if f"{r.feature}/{r.paired_with}" == pairing)
    expected = row.message.format(model_type="m", draft_model="d", draft_vocab_size=512, target_vocab_size=300,
                                  **vars(config))
    with pytest.raises(ValueError) as refused:
        refusals.check(config, specs, draft, "m")
    assert str(refused.value) == expected


def test_a_config_pairing_is_refused_when_the_config_is_made():
    with pytest.raises(ValueError, match="disk_cache_dir is not supported with tensor parallelism"):
        EngineConfig(disk_cache_dir="/tmp/d", tensor_parallel_size=2)


def test_full_attention_and_windows_pair_with_every_feature():
    for fields in ({"speculative": "ngram+draft:d"}, {"disk_cache_dir": "/tmp/d"}, {"tensor_parallel_size": 2}):
        refusals.check(EngineConfig(**fields), (WINDOW, FULL, WINDOW), DraftFacts((FULL,)), "gemma3_text")


def test_recurrent_layers_pair_with_tensor_parallelism_speculation_and_the_disk_tier():
    """State checkpoints go to disk beside the blocks (kv/disk/checkpoints.py; test_disk_cache_hybrid.py)."""
    for fields in ({"tensor_parallel_size": 2}, {"speculative": "ngram+draft:d"}, {"disk_cache_dir": "/tmp/d"}):
        refusals.check(EngineConfig(**fields), (RECURRENT, RECURRENT, FULL), DraftFacts((FULL,)), "qwen3_5_text")


def test_a_small_step_budget_pairs_with_attention_and_a_shared_layer_with_an_attention_source():
    refusals.check(EngineConfig(max_num_batched_tokens=8, block_size=16), (WINDOW, FULL), None, "gemma3_text")
    refusals.check(EngineConfig(), (WINDOW, FULL, SharedKV(0), SharedKV(1)), None, "gemma4_text")
