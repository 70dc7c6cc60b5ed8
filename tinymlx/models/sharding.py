"""Sharded linears: each rank keeps a slice of a linear layer's weights (float or quantized).

    column-parallel (q/k/v, gate/up):   x [N, in]  @ W[out/p, in]      -> y_r [N, out/p]    (whole heads)
    row-parallel    (o_proj, down):     y_r [N, in/p] @ W[out, in/p]   -> partial [N, out] --all_sum--> [N, out]
    vocab-parallel  (lm_head):          x [S, in]  @ W[vocab/p, in]    -> [S, vocab/p] --all_gather--> [S, vocab]
    experts (MoE):  each expert's gate/up column-parallel, down row-parallel; the block sums the
                    weighted experts locally and all-reduces once, like a dense MLP.

The slicing itself is MLX's `shard_inplace`, which knows the packed layout of quantized weights;
the module types stay what they were, so the float32 [in, out] layout and quantization apply after.
These live with the models (not in parallel/), since a family's layers shard themselves and
parallel/ sits above the runner.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace


def shard_output_features(parent: nn.Module, name: str, group: mx.distributed.Group) -> None:
    """Column-parallel: keep this rank's slice of `parent.<name>`'s output features (and bias)."""
    shard_inplace(getattr(parent, name), "all-to-sharded", group=group)


def shard_input_features(parent: nn.Module, name: str, group: mx.distributed.Group,
                         all_reduce: Callable[[mx.array], mx.array]) -> None:
    """Row-parallel: keep this rank's slice of the input features; outputs are summed over the ranks."""
    linear = getattr(parent, name)
    shard_rows(linear, group)
    setattr(parent, name, AllReduceLinear(linear, all_reduce))


def shard_rows(linear: nn.Module, group: mx.distributed.Group) -> None:
    """This rank's slice of a linear's (or every expert's) input features, for outputs the caller sums over
    the ranks: each rank adds its share of a bias (gpt-oss's o_proj and experts have one)."""
    shard_inplace(linear, "sharded-to-all", group=group)
    if "bias" in linear:
        linear.bias = linear.bias / group.size()


def shard_gated_mlp(mlp: nn.Module, group: mx.distributed.Group) -> None:
    """gate_proj and up_proj column-parallel, down_proj row-parallel, its partial outputs left to be summed
    (an MoE block sums them with its routed experts' in one all-reduce)."""
    for name in ("gate_proj", "up_proj"):
        shard_output_features(mlp, name, group)
    shard_rows(mlp.down_proj, group)


class AllReduceLinear(nn.Module):
    """A row-parallel linear: this rank's partial output, summed over all ranks."""

    def __init__(self, linear: nn.Module, all_reduce: Callable[[mx.array], mx.array]):
        super().__init__()
        self.linear = linear
        self._all_reduce = all_reduce

    def __call__(self, x: mx.array) -> mx.array:
        return self._all_reduce(self.linear(x))


def embedding_rows_as_linear(embedding: nn.Module, x: mx.array, rows: slice) -> mx.array:
    """`embedding.as_linear(x)` for the vocabulary `rows` only: a tied lm_head's slice, read in place."""
    if isinstance(embedding, nn.QuantizedEmbedding):
        biases = embedding.get("biases")
        return mx.quantized_matmul(
            x, embedding.weight[rows], scales=embedding.scales[rows],
            biases=None if biases is None else biases[rows], transpose=True,
            group_size=embedding.group_size, bits=embedding.bits, mode=embedding.mode,
        )
    return x @ embedding.weight[rows].T
