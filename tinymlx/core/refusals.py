"""The one table of what the engine does not do: a feature paired with a kind of layer state, with another
feature, or with what the feature's own model is (a draft's tokenizer and vocabulary), each with its reason.
Nothing else refuses a pairing: `check` runs where the facts are first known (the config alone at
construction, a draft's tokenizer before its weights load, the model's layer kinds at load, before any rank
starts) and raises the row's message.

One pairing is not refused but done without: a hybrid model's prefix cache keeps no partial last blocks
(tails), as its recurrent state exists only where a checkpoint was kept (kv/coordinator.py
`keeps_tails`). What a tail would save instead comes from the checkpoint each decode leaves at every block
end of a reply: the next turn recomputes at most block_size - 1 of the last reply's tokens
(tests/test_hybrid.py: a 30-token prompt and a 40-token reply, the next turn resumes at token 68 of 69).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from tinymlx.core.layer_specs import FullAttention, LayerSpec, Recurrent, SharedKV, SlidingWindow
from tinymlx.core.speculative_config import SpeculativeConfig


class Asked(Protocol):
    """What of EngineConfig the table reads (config.py calls `check` itself, so it is not imported here)."""

    speculative: str | None
    disk_cache_dir: str | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_num_batched_tokens: int
    block_size: int


@dataclass(frozen=True)
class DraftFacts:
    """What a proposer's model is, where the engine loads it: the draft model's (or MTP head's) layer kinds and
    vocabulary, against the target's."""

    specs: Sequence[LayerSpec] = ()
    is_loaded: bool = True  # the speculative setting's model (a draft, or the checkpoint's MTP head) was given
    vocab_size: int = 0  # the draft's embedding rows (0: not known yet)
    target_vocab_size: int = 0
    same_tokenizer: bool = True  # the draft tokenizes as the target does (its tokenizer files)


class Refusal(NamedTuple):
    feature: str  # what the config asks for
    paired_with: str  # what the model (or the config) has
    message: str  # formatted with the config's fields and `model_type`


_DRAFT_SHARES_FULL_TABLES = ("draft-model speculation needs a target with full-attention layers and a draft with "
                             "only those: the draft's pool shares the target's full-attention block tables")

REFUSALS = (
    Refusal("draft model", "draft sliding-window layers",
            _DRAFT_SHARES_FULL_TABLES),
    Refusal("draft model", "no full-attention layers",
            _DRAFT_SHARES_FULL_TABLES),
    Refusal("draft model", "draft recurrent layers",
            _DRAFT_SHARES_FULL_TABLES),
    Refusal("draft model", "no draft model",
            "draft-model speculation needs the draft model: build with Engine.load or LLM"),
    Refusal("draft model", "another tokenizer",
            "the draft model {draft_model!r} has another vocabulary than the target: a draft must tokenize exactly as "
            "the target does (same tokenizer), e.g. a smaller model of its family"),
    Refusal("draft model", "a larger draft vocabulary",
            # The draft's logits index the target's vocabulary; sizes may differ by padding only.
            "the draft model {draft_model!r} has a vocabulary of {draft_vocab_size} tokens, the target "
            "{target_vocab_size}: a draft must share the target's vocabulary"),
    Refusal("MTP head", "no MTP head",
            "speculative='mtp' needs the checkpoint's MTP head: build with Engine.load or LLM"),
    Refusal("MTP head", "tensor parallelism",
            # The head and its pool live on rank 0, which has only its shard of the target's hidden states.
            "speculative='mtp' is not supported with tensor parallelism: use tensor_parallel_size=1, or "
            "speculative='ngram'"),
    Refusal("disk tier", "tensor parallelism",
            "disk_cache_dir is not supported with tensor parallelism (each rank holds a slice of the KV heads): "
            "use tensor_parallel_size=1 or leave disk_cache_dir unset"),
    Refusal("pipeline parallelism", "a family that cannot split",
            # A vision-language model's forward merges image features into the hidden states, on no stage yet.
            "{model_type} models cannot be split into pipeline stages yet: use pipeline_parallel_size=1"),
    Refusal("MTP head", "pipeline parallelism",
            "speculative='mtp' is not supported with pipeline parallelism yet: use speculative='ngram'"),
    Refusal("disk tier", "pipeline parallelism",
            "disk_cache_dir is not supported with pipeline parallelism yet (each stage would keep its own layers' "
            "blocks): leave disk_cache_dir unset"),
    Refusal("a step budget below a block", "recurrent layers",
            # A recurrent state is kept (checkpointed) only at block ends, so every prefill chunk ends on one.
            "max_num_batched_tokens={max_num_batched_tokens} is below block_size={block_size}: a model with "
            "recurrent layers computes prefill chunks that end on block ends"),
    Refusal("KV-shared layers", "a shared source without K/V",
            "{model_type}: a KV-shared layer reads the K/V of a layer that keeps none (a recurrent layer); "
            "only attention layers can lend their K/V"),
)


def check(config: Asked, specs: Sequence[LayerSpec] | None = None, draft: DraftFacts | None = None,
          model_type: str = "", splits_into_stages: bool = True) -> None:
    """ValueError with the message of the first pairing in REFUSALS that `config`, the model's layer kinds
    and the proposer's model make (`specs` None: the config's own pairings only; `draft` None: none loaded yet;
    `splits_into_stages`: whether the model's forward can run as pipeline stages)."""
    present = _features(config) | _kinds(specs, draft) | _draft_kinds(draft)
    if not splits_into_stages:
        present.add("a family that cannot split")
    for refusal in REFUSALS:
        if refusal.feature in present and refusal.paired_with in present:
            speculative = SpeculativeConfig.parse(config.speculative) if config.speculative else None
            raise ValueError(refusal.message.format(
                model_type=model_type, draft_model=speculative.draft_model if speculative else None,
                draft_vocab_size=draft.vocab_size if draft else 0,
                target_vocab_size=draft.target_vocab_size if draft else 0, **vars(config)))


def _features(config: Asked) -> set[str]:
    speculative = SpeculativeConfig.parse(config.speculative) if config.speculative else None
    asked = {"draft model": speculative is not None and "draft" in speculative.proposers,
             "MTP head": speculative is not None and "mtp" in speculative.proposers,
             "disk tier": config.disk_cache_dir is not None,
             "tensor parallelism": config.tensor_parallel_size > 1,
             "pipeline parallelism": config.pipeline_parallel_size > 1,
             "a step budget below a block": config.max_num_batched_tokens < config.block_size}
    return {feature for feature, on in asked.items() if on}


def _kinds(specs: Sequence[LayerSpec] | None, draft: DraftFacts | None) -> set[str]:
    if specs is None:
        return set()
    draft_specs = draft.specs if draft is not None else ()
    kinds = {"recurrent layers": any(isinstance(s, Recurrent) for s in specs),
             "no full-attention layers": not any(isinstance(s, FullAttention) for s in specs),
             "draft sliding-window layers": any(isinstance(s, SlidingWindow) for s in draft_specs),
             "draft recurrent layers": any(isinstance(s, Recurrent) for s in draft_specs),
             "KV-shared layers": any(isinstance(s, SharedKV) for s in specs),
             "a shared source without K/V": any(isinstance(s, SharedKV) and isinstance(specs[s.source], Recurrent)
                                                for s in specs)}
    return {kind for kind, has in kinds.items() if has}


def _draft_kinds(draft: DraftFacts | None) -> set[str]:
    if draft is None:
        return set()
    kinds = {"no draft model": not draft.is_loaded, "no MTP head": not draft.is_loaded,
             "another tokenizer": not draft.same_tokenizer,
             "a larger draft vocabulary": draft.vocab_size > draft.target_vocab_size > 0}
    return {kind for kind, has in kinds.items() if has}
