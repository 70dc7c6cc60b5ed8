"""The one table of pairings the engine does not do yet (core/refusals.py): each row fires for exactly its
pairing, with its message, and a plain full-attention model pairs with every feature."""

from __future__ import annotations

import pytest

from tinymlx.core import refusals
from tinymlx.core.config import EngineConfig
from tinymlx.core.layer_specs import FullAttention, Recurrent, SlidingWindow

FULL, WINDOW, RECURRENT = FullAttention(), SlidingWindow(8), Recurrent(4, 16, 2, 8, 8)
# config fields, the target's layer kinds, the draft's -> the row expected
CASES = {
    "speculative decoding/recurrent layers": ({"speculative": "ngram"}, (FULL, RECURRENT), ()),
    "draft model/draft sliding-window layers": ({"speculative": "draft:d"}, (FULL,), (FULL, WINDOW)),
    "draft model/no full-attention layers": ({"speculative": "draft:d"}, (WINDOW,), (FULL,)),
    "tensor parallelism/recurrent layers": ({"tensor_parallel_size": 2}, (FULL, RECURRENT), ()),
}


def test_every_row_has_a_case():
    assert {f"{r.feature}/{r.paired_with}" for r in refusals.REFUSALS} == set(CASES) | {"disk tier/tensor parallelism"}


@pytest.mark.parametrize("pairing", list(CASES))
def test_each_row_refuses_its_pairing_with_its_message(pairing):
    fields, specs, draft_specs = CASES[pairing]
    config = EngineConfig(**fields)  # the config alone pairs with no layer kind: it is accepted
    row = next(r for r in refusals.REFUSALS if f"{r.feature}/{r.paired_with}" == pairing)
    expected = row.message.format(model_type="m", **vars(config))
    with pytest.raises(ValueError) as refused:
        refusals.check(config, specs, draft_specs, "m")
    assert str(refused.value) == expected


def test_a_config_pairing_is_refused_when_the_config_is_made():
    with pytest.raises(ValueError, match="disk_cache_dir is not supported with tensor parallelism"):
        EngineConfig(disk_cache_dir="/tmp/d", tensor_parallel_size=2)


def test_full_attention_and_windows_pair_with_every_feature():
    for fields in ({"speculative": "ngram+draft:d"}, {"disk_cache_dir": "/tmp/d"}, {"tensor_parallel_size": 2}):
        refusals.check(EngineConfig(**fields), (WINDOW, FULL, WINDOW), (FULL,), "gemma3_text")


def test_recurrent_layers_pair_with_the_disk_tier():
    """Their state checkpoints go to disk beside the blocks (kv/disk/checkpoints.py; test_disk_cache_hybrid.py)."""
    refusals.check(EngineConfig(disk_cache_dir="/tmp/d"), (RECURRENT, RECURRENT, FULL), (), "qwen3_5_text")
