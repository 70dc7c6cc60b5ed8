"""A step's activations: the bytes a forward allocates beyond the weights and pools while it runs, as plain
arithmetic on the model's dims. The budget reserves the largest step's (core/config.py), and the scheduler
sizes prefill chunks so that no step's estimate passes it (sched/scheduler.py).

The runner (runner/model_runner.py) splits each chunk into query tiles of at most QUERY_TILE tokens and
groups the tiles and decodes by reach (blocks read, within a power of two); each group is padded to
[pieces, longest tile, longest context] and gathers its own copy of every piece's context (where the
runner joins a chunk's tiles of one group into one piece, it gathers once: the estimate stays above):

    per group:  scores and their softmax  2 x heads x B x L x T x 4   (float32; the CPU's softmax copies)
                gathered K and V          2 x kv_heads x B x T x head_dim x kv itemsize
                visible mask              B x L x T
    per token:  residual, norms, q/k/v, MLP gate/up/product  (float32)
    per row that samples: its logits and the sampler's copies of them

Only the attention terms grow with the context: at an 8k context they are most of a 512-token chunk's
peak. Measured against mx.get_peak_memory() (tests/test_peak_memory.py), the estimate is above the peak
on the portable path and the CPU's (scores and weights both live only on the CPU's, which evaluates its
softmax through numpy), so one estimate serves either set of kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tinymlx.core.layer_specs import Attends, LayerSpec

QUERY_TILE = 64  # the runner's query tiles (model_runner.py `query_tile`)
_SCORE_COPIES = 2  # scores and their unnormalized softmax, both float32
_TOKEN_HIDDEN_COPIES = 6  # embedding, residual, norm outputs, attention output, o_proj and down_proj outputs
_TOKEN_MLP_COPIES = 3  # gate, up, and their gated product
_TOKEN_QKV_COPIES = 2  # q/k/v projections, and q and k after RoPE
_LOGIT_COPIES = 4  # logits, float32 log-probabilities, probabilities, the sorted copy top-p/top-k take


class StepShape(NamedTuple):
    """What the estimate reads of a model: the widest attention layer's heads and head_dim (Gemma 4's
    global layers), and the pool's block size and K/V itemsize (what a gather copies)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    block_size: int
    kv_itemsize: int

    @classmethod
    def of(cls, args, specs: tuple[LayerSpec, ...], block_size: int, kv_itemsize: int) -> StepShape:
        attending = [spec for spec in specs if isinstance(spec, Attends)]
        kv_heads = max([args.num_key_value_heads, *(spec.kv_heads or 0 for spec in attending)])
        head_dim = max([args.head_dim, *(spec.head_dim or 0 for spec in attending)])
        intermediate = getattr(args, "intermediate_size", 0) or 4 * args.hidden_size
        return cls(args.hidden_size, intermediate, args.num_attention_heads, kv_heads, head_dim, args.vocab_size,
                   block_size, kv_itemsize)


Piece = tuple[int, int]  # (tokens a chunk computes, the context it reads up to: its end position)


class StepActivations(NamedTuple):
    """activation_bytes's terms over the pieces added so far: each reach group's (pieces, longest tile,
    longest context), the tokens and the pieces. Adding a piece costs its own tiles, not the step's, so
    the scheduler builds a step's estimate chunk by chunk instead of again for each chunk it sizes."""

    shape: StepShape
    groups: dict[tuple[bool, int], tuple[int, int, int]] = {}  # (tiles, reach) -> (B, L, T); never mutated
    num_tokens: int = 0
    num_pieces: int = 0

    def plus(self, pieces: Sequence[Piece]) -> StepActivations:
        groups = dict(self.groups)
        for num_tokens, end in pieces:  # tiles and groups as model_runner's `_attention_groups`
            num_tiles = -(-num_tokens // QUERY_TILE)
            ends = [num_tokens * (i + 1) // num_tiles for i in range(num_tiles)]
            for start, tile_end in zip([0, *ends], ends):
                blocks = -(-(end - num_tokens + tile_end) // self.shape.block_size)
                key = (tile_end - start > 1, (blocks - 1).bit_length())
                B, L, T = groups.get(key, (0, 0, 0))
                groups[key] = (B + 1, max(L, tile_end - start), max(T, blocks * self.shape.block_size))
        return self._replace(groups=groups, num_tokens=self.num_tokens + sum(n for n, _ in pieces),
                             num_pieces=self.num_pieces + len(pieces))

    def merged(self, other: StepActivations) -> StepActivations:
        groups = dict(self.groups)
        for key, (B, L, T) in other.groups.items():
            pieces, longest_tile, longest_context = groups.get(key, (0, 0, 0))
            groups[key] = (B + pieces, max(L, longest_tile), max(T, longest_context))
        return self._replace(groups=groups, num_tokens=self.num_tokens + other.num_tokens,
                             num_pieces=self.num_pieces + other.num_pieces)

    def bytes(self, num_sampled: int | None = None) -> int:
        """Peak activation bytes of the step; `num_sampled` rows sample (None: one per piece)."""
        shape, total = self.shape, 0
        for B, L, T in self.groups.values():
            total += _SCORE_COPIES * shape.heads * B * L * T * 4 + B * L * T
            total += 2 * shape.kv_heads * B * T * shape.head_dim * shape.kv_itemsize
        per_token = (_TOKEN_HIDDEN_COPIES * shape.hidden + _TOKEN_MLP_COPIES * shape.intermediate
                     + _TOKEN_QKV_COPIES * (shape.heads + 2 * shape.kv_heads) * shape.head_dim) * 4
        rows = self.num_pieces if num_sampled is None else num_sampled
        return total + self.num_tokens * per_token + rows * shape.vocab * 4 * _LOGIT_COPIES


def activation_bytes(shape: StepShape, chunks: Sequence[Piece], num_sampled: int | None = None) -> int:
    """Peak activation bytes of a step computing `chunks`; `num_sampled` rows sample (None: one per chunk)."""
    return StepActivations(shape).plus(chunks).bytes(num_sampled)


def largest_chunk(beside: StepActivations, start: int, wanted: int, allowance: int) -> int:
    """The most tokens (up to `wanted`) a chunk from position `start` may compute beside the step's other
    pieces with its activations within `allowance` (0: not even one). The estimate grows with the chunk:
    bisect."""
    def fits(n: int) -> bool:
        return beside.plus([(n, start + n)]).bytes() <= allowance

    if fits(wanted):
        return wanted
    low, high = 0, wanted - 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low
