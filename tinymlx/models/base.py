"""The model interface every family satisfies, and the kinds of state its layers keep.

The engine, runner, config and parallel/ see a model only through `CausalLM` and `BaseModelArgs`:

    model(tokens [N], positions [N], attention, rows [S]) -> hidden [S, hidden]   (flat tokens of many
                                                  sequences; only `rows` leave the last layer, all N without)
    model.logits(hidden [S, hidden])              -> [S, vocab]
    model.layer_specs()                           -> one LayerSpec per layer: what its cache keeps
    (recurrent layers call attention.conv1d / attention.delta_rule: the step's states, read and written)
    model.shard(group, all_reduce, gather_vocab)  -> keep this rank's tensor-parallel slice
    model.keep_stage(stage)                       -> keep one pipeline stage's layers (and ends)
    model(tokens, positions, attention, rows, hidden=h) -> a later stage, from the stage before's hidden states
    model.sanitize(weights)                       -> checkpoint names -> this module tree's names

A model knows no cache: *how* attention reaches each sequence's K/V is the backend passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from tinymlx.core.images import ProcessedImage, PromptImages
from tinymlx.core.layer_specs import FullAttention, LayerSpec, SlidingWindow
from tinymlx.core.pipeline_stage import PipelineStage, whole_model
from tinymlx.models.hf_config import FULL, SLIDING
from tinymlx.models.sharding import embedding_rows_as_linear, shard_output_features


class AttentionBackend(Protocol):
    """Stores this step's K/V for `layer` and returns attention output [N, num_heads, head_dim].
    `scale` multiplies the scores: each family has its own (1/sqrt(head_dim), Gemma's query_pre_attn_scalar);
    `sinks` [num_heads]: a learned logit per head in every softmax, with no value (gpt-oss)."""

    def __call__(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float,
                 sinks: mx.array | None = None) -> mx.array: ...

    # Recurrent layers (Recurrent specs) use these instead, over the same flat tokens [N, ...]:
    def conv1d(self, layer: int, x: mx.array, weight: mx.array) -> mx.array:
        """Each sequence's depthwise causal convolution of x [N, C] (weight [C, K]), carrying its last inputs."""
        ...

    def delta_rule(self, layer: int, q: mx.array, k: mx.array, v: mx.array, g: mx.array,
                   beta: mx.array) -> mx.array:
        """Each sequence's gated delta rule (gated_delta.py): q, k [N, H, Dk], v [N, H, Dv], g, beta [N, H]
        -> [N, H, Dv], carrying its state."""
        ...


class TensorParallelGroup(Protocol):
    """What sharding a model needs of the rank group (tinymlx.parallel.collectives.Collectives)."""

    group: mx.distributed.Group
    size: int

    def all_reduce(self, x: mx.array) -> mx.array: ...
    def gather_vocab(self, x: mx.array) -> mx.array: ...


class ImageRows(NamedTuple):
    """A step's image tokens: their embeddings (the vision tower's output, from the encoder cache) and the
    rows of the flat batch they take, in place of their placeholder tokens' embeddings."""

    features: mx.array  # [M, hidden]
    rows: mx.array  # [M]

    def placed_in(self, embeds: mx.array) -> mx.array:
        """The input embeddings [N, hidden] with the image tokens' rows replaced by their features."""
        embeds[self.rows] = self.features.astype(embeds.dtype)
        return embeds


@dataclass(frozen=True, kw_only=True)
class BaseModelArgs:
    """What the engine reads of any family's arguments; field names are Hugging Face's config keys."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()  # () : every layer full attention
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # a list from JSON or asdict

    def ffn_widths(self) -> dict[str, int]:
        """Row-parallel linears' input widths, by name: each must split evenly over the ranks."""
        return {"down_proj": self.intermediate_size}

    def whole_heads(self) -> dict[str, int]:
        """Heads of other mixers than attention, by name: each rank computes whole ones, too."""
        return {}

    def row_parallel_widths(self) -> dict[str, int]:
        """Every row-parallel linear's input width, by name: each rank's share must hold whole quantization groups."""
        return {"o_proj": self.num_attention_heads * self.head_dim, **self.ffn_widths()}


class CausalLM(nn.Module):
    """A decoder-only LM with `self.model.embed_tokens`, `.layers` (each knowing how to shard itself) and an
    optional `self.lm_head`. Module names follow Hugging Face."""

    # A vision-language model (models/qwen2_5_vl.py) sees images: it places them in a prompt
    # (`place_images`), encodes them (`encode_images`) and takes their rows in its forward (`images=`).
    sees_images = False
    tower_prefixes: tuple[str, ...] = ()  # its vision modules' names: plain MLX on every path
    # Positions are [3, N] (temporal, height, width: Qwen's M-RoPE) where a step has images; [N] otherwise.
    has_multimodal_rope = False

    def __init__(self, args: BaseModelArgs):
        super().__init__()
        self.args = args
        self.tensor_parallel_size = 1
        self._vocab_rows: slice | None = None  # under tensor parallelism: this rank's slice of the vocabulary
        self._gather_vocab: Callable[[mx.array], mx.array] | None = None
        self.stage = whole_model(args.num_hidden_layers)  # under pipeline parallelism, one stage's (keep_stage)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank computes and caches (all of them without tensor parallelism)."""
        return self.args.num_key_value_heads // self.tensor_parallel_size

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """Each layer's kind of state."""
        return self.layer_specs_of(self.args)

    @classmethod
    def layer_specs_of(cls, args: BaseModelArgs) -> tuple[LayerSpec, ...]:
        """Each layer's kind of state for a model of `args`, from its HF layer types (no module built)."""
        kinds = {FULL: FullAttention()}
        if args.sliding_window is not None:
            kinds[SLIDING] = SlidingWindow(args.sliding_window)
        types = args.layer_types or (FULL,) * args.num_hidden_layers
        unknown = sorted(set(types) - set(kinds))
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported by {cls.__module__}")
        return tuple(kinds[t] for t in types)

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None, hidden: mx.array | None = None) -> mx.array:
        """Hidden states [N, hidden] for flat `tokens` [N] at `positions` [N]; with `rows` [S], those rows'
        only [S, hidden]: the last layer still writes every token's K/V, but runs its MLP on `rows` alone.
        A pipeline stage after the first starts from `hidden` [N, hidden], the stage before's output; a stage
        before the last returns every row's hidden states, before the final norm."""
        return self.model(tokens, positions, attention, rows, embeds=hidden)

    def keep_stage(self, stage: PipelineStage) -> None:
        """Keep only `stage`'s part of the model (call before loading weights: `stage_weights` then names what
        it reads). The other decoder layers become None, so those kept keep their checkpoint names."""
        # Every decoder stack runs a stage (layers.finish_stage; Gemma 4's hands its per-layer inputs on too); a
        # vision model's forward, which merges images into the hidden states, does not yet.
        assert not self.sees_images, "refused by load_model (core/refusals.py)"
        inner = self.model
        inner.layers = [layer if i in stage.layers else None for i, layer in enumerate(inner.layers)]
        if not stage.is_first and not (stage.is_last and self.args.tie_word_embeddings):
            del inner.embed_tokens
        if not stage.is_last:
            del inner.norm
            if "lm_head" in self:
                del self.lm_head
        self.stage = inner.stage = stage

    def stage_weights(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The checkpoint tensors (as `sanitize` names them) this stage's modules hold: only those are read
        (mx.load is lazy)."""
        if self.stage.holds_everything:
            return weights
        held = {name.rsplit(".", 1)[0] for name, _ in tree_flatten(self.parameters())}  # modules with parameters
        return {name: value for name, value in weights.items() if name.rsplit(".", 1)[0] in held}

    def attends_whole_images(self, spec: LayerSpec) -> bool:
        """Whether layers of this kind let an image's tokens attend to each other both ways (Gemma)."""
        return False

    def place_images(self, token_ids: list[int], images: list[ProcessedImage],
                     encode: Callable[[str], list[int]] | None = None) -> tuple[list[int], PromptImages]:
        """The prompt with each image's placeholder expanded to its tokens, and where the images sit. `encode`:
        text -> token ids, for a family whose processor writes text around each image (Gemma 3)."""
        raise ValueError(f"{self.args.model_type} models read text only")

    def encode_images(self, images: list[ProcessedImage]) -> list[mx.array]:
        """Each image's token embeddings [num_tokens, hidden], from one run of the vision tower."""
        raise ValueError(f"{self.args.model_type} models read text only")

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits [rows, vocab]. Sharded, each rank computes its slice of the vocabulary and the
        slices are gathered: every rank must call this with the same rows."""
        tied = self.args.tie_word_embeddings
        if self._vocab_rows is None:
            return self.model.embed_tokens.as_linear(hidden) if tied else self.lm_head(hidden)
        if tied:
            logits = embedding_rows_as_linear(self.model.embed_tokens, hidden, self._vocab_rows)
        else:
            logits = self.lm_head(hidden)
        return self._gather_vocab(logits)

    @classmethod
    def check_shardable(cls, args: BaseModelArgs, size: int, quant_group_size: int | None = None) -> None:
        """Raise ValueError, naming the sizes that would work, unless every layer splits evenly over `size` ranks."""
        if size == 1:
            return
        problems = []
        if args.num_attention_heads % size or args.num_key_value_heads % size:
            problems.append(f"{args.num_attention_heads} attention heads and {args.num_key_value_heads} KV heads "
                            "(each rank computes whole heads)")
        heads = args.whole_heads()
        problems += [f"{count} {name} (each rank computes whole heads)" for name, count in heads.items() if count % size]
        ffn = args.ffn_widths()
        problems += [f"an FFN width of {width}" + ("" if name == "down_proj" else f" ({name})")
                     for name, width in ffn.items() if width % size]
        if args.vocab_size % size:
            problems.append(f"a vocabulary of {args.vocab_size} (each rank computes the logits of an equal slice)")
        if quant_group_size and not problems:
            for name, features in args.row_parallel_widths().items():
                if (features // size) % quant_group_size:
                    problems.append(f"{name}'s {features // size} input features per rank, not a multiple of the "
                                    f"quantization group size {quant_group_size}")
        if problems:
            width = math.gcd(args.num_attention_heads, args.num_key_value_heads, *heads.values(), *ffn.values(),
                             args.vocab_size)
            valid = [n for n in range(2, width + 1) if width % n == 0][:6]
            hint = f"; sizes that divide the heads, FFN and vocabulary: {', '.join(map(str, valid))}" if valid else ""
            raise ValueError(f"tensor_parallel_size={size} cannot split this model: {'; '.join(problems)}{hint}")

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array],
              gather_vocab: Callable[[mx.array], mx.array]) -> None:
        """Keep this rank's slice of every layer, Megatron style (call before any dtype conversion).

        Each layer's mixer (attention, or a recurrent one) and MLP split their own linears (see the layers'
        `shard`): one all-reduce each, two per layer. The lm_head keeps a slice of the vocabulary, whose logits are gathered (one
        all-gather per step); the embedding stays whole, since every rank looks up every token.
        """
        size, rank = group.size(), group.rank()
        for layer in self.model.layers:
            if layer is not None:  # a pipeline stage's other layers
                layer.shard(group, all_reduce)
        if not self.args.tie_word_embeddings and "lm_head" in self:  # a pipeline stage before the last has none
            shard_output_features(self, "lm_head", group)
        per_rank = self.args.vocab_size // size
        self._vocab_rows, self._gather_vocab = slice(rank * per_rank, (rank + 1) * per_rank), gather_vocab
        self.tensor_parallel_size = size

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint tensors renamed to this module tree. Rotary tables are recomputed, never loaded;
        a tied checkpoint's lm_head is dropped."""
        return {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k
                and not (self.args.tie_word_embeddings and k == "lm_head.weight")}
