"""A sparse mixture-of-experts block whose experts run batched: one gather-matmul per projection.

    tokens [N] x top-k  ->  N*k (token, expert) rows, sorted by expert
                        ->  gate/up/down as mx.gather_mm (gather_qmm when quantized) over the rows:
                            each expert's weights read once for all of its rows, no loop over experts
                        ->  rows back in token order, weighted by their router scores, summed over k
"""

from __future__ import annotations

import re
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from tinymlx.core.errors import ModelLoadError
from tinymlx.models.layers import MLP, silu_mul
from tinymlx.models.sharding import shard_gated_mlp
from tinymlx.ops import kernels

_EXPERT = re.compile(r"(?P<mlp>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


class SwitchLinear(nn.Module):
    """One linear per expert, weight [experts, out, in] (each expert's HF [out, in], stacked), with a bias
    [experts, out] where the family has one (gpt-oss)."""

    def __init__(self, num_experts: int, input_dims: int, output_dims: int, bias: bool = False):
        super().__init__()
        scale = input_dims**-0.5
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        """x [R, 1, in] and each row's expert [R] (sorted) -> [R, 1, out]."""
        y = mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)
        return _with_bias(self, y, experts)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> QuantizedSwitchLinear:
        return QuantizedSwitchLinear.from_switch_linear(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    def __init__(self, num_experts: int, input_dims: int, output_dims: int, group_size: int = 64, bits: int = 4,
                 mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(
            mx.zeros((num_experts, output_dims, input_dims)), group_size=group_size, bits=bits, mode=mode)
        if biases:
            self.biases = biases[0]
        self.freeze()

    @classmethod
    def from_switch_linear(cls, linear: SwitchLinear, group_size: int, bits: int, mode: str) -> QuantizedSwitchLinear:
        num_experts, output_dims, input_dims = linear.weight.shape
        quantized = cls(num_experts, input_dims, output_dims, group_size, bits, mode)
        quantized.weight, quantized.scales, *biases = mx.quantize(linear.weight, group_size=group_size, bits=bits,
                                                                  mode=mode)
        if biases:
            quantized.biases = biases[0]
        if "bias" in linear:
            quantized.bias = linear.bias
        return quantized

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        y = mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"), rhs_indices=experts,
                          transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
                          sorted_indices=True)
        return _with_bias(self, y, experts)


def _with_bias(linear: nn.Module, y: mx.array, experts: mx.array) -> mx.array:
    return y + linear["bias"][experts][:, None, :] if "bias" in linear else y


class SwitchMLP(nn.Module):
    """The experts' gated MLPs, as three SwitchLinears (mlx-lm's names, so its MoE checkpoints load)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int,
                 act: Callable[[mx.array, mx.array], mx.array] = silu_mul, bias: bool = False):
        super().__init__()
        self.gate_proj = SwitchLinear(num_experts, dim, hidden_dim, bias)
        self.up_proj = SwitchLinear(num_experts, dim, hidden_dim, bias)
        self.down_proj = SwitchLinear(num_experts, hidden_dim, dim, bias)
        self.act = act

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x, experts), self.up_proj(x, experts)), experts)


class SparseMoE(nn.Module):
    """Softmax router over `num_experts`, the top `top_k` per token (renormalized with `norm_topk_prob`)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 act: Callable[[mx.array, mx.array], mx.array] = silu_mul, bias: bool = False):
        """`bias`: the router and every expert's linears carry one (gpt-oss)."""
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=bias)
        self.switch_mlp = SwitchMLP(dim, hidden_dim, num_experts, act, bias)
        self._all_reduce: Callable[[mx.array], mx.array] | None = None

    def __call__(self, x: mx.array) -> mx.array:
        out = self.local(x)
        return out if self._all_reduce is None else self._all_reduce(out)

    def local(self, x: mx.array) -> mx.array:
        """This rank's part of the block's output (all of it without tensor parallelism)."""
        k = self.top_k
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1, precise=True)
        experts = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # the top k, in no order
        scores = mx.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return mix_experts(self.switch_mlp, x, experts, scores)

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        """Every expert's FFN split like a dense MLP; the router stays whole (every rank routes alike),
        and the weighted sum over the experts is all-reduced once."""
        shard_gated_mlp(self.switch_mlp, group)
        self._all_reduce = all_reduce


def mix_experts(switch_mlp: SwitchMLP, x: mx.array, experts: mx.array, scores: mx.array) -> mx.array:
    """x [N, D] through each token's k `experts` [N, k], weighted by `scores` [N, k] and summed."""
    N, D = x.shape
    k = experts.shape[-1]
    # Sort the N*k (token, expert) rows by expert, so each expert's rows are contiguous.
    flat = experts.flatten()
    order = mx.argsort(flat)
    rows = x[order // k][:, None, :]  # [N*k, 1, D]
    y = switch_mlp(rows, flat[order])[:, 0, :]
    y = y[mx.argsort(order)].reshape(N, k, D)  # back in (token, slot) order
    return (y * scores[:, :, None].astype(y.dtype)).sum(axis=1)


class SharedExpertMoE(SparseMoE):
    """SparseMoE plus a dense shared expert that every token also runs, scaled by a per-token gate
    sigmoid(shared_expert_gate(x)) (Qwen3-Next, Qwen3.5-MoE)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_hidden_dim: int, act: Callable[[mx.array, mx.array], mx.array] = silu_mul):
        super().__init__(dim, hidden_dim, num_experts, top_k, norm_topk_prob, act)
        self.shared_expert = MLP(dim, shared_hidden_dim, act)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def local(self, x: mx.array) -> mx.array:
        return super().local(x) + self.shared_expert(x) * kernels.sigmoid(self.shared_expert_gate(x))

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        """The shared expert splits like a dense MLP whose partial output joins the routed experts' before
        the block's one all-reduce; its gate stays whole (a per-token scalar, the same on every rank)."""
        super().shard(group, all_reduce)
        shard_gated_mlp(self.shared_expert, group)


def stack_experts(weights: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """Every MoE checkpoint layout as `mlp.switch_mlp.*` [E, out, in] (mlx-lm's names): one linear per
    expert (`mlp.experts.E.gate_proj.weight`, transformers 4.x and the Hub), or packed
    (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I], transformers 5.x)."""
    out: dict[str, mx.array] = {}
    per_expert: dict[tuple[str, str], dict[int, mx.array]] = {}
    for name, value in weights.items():
        if match := _EXPERT.fullmatch(name):
            per_expert.setdefault((match["mlp"], match["proj"]), {})[int(match["expert"])] = value
        elif name.endswith(".mlp.experts.gate_up_proj"):  # gate first
            gate, up = mx.split(value, 2, axis=1)
            mlp = name.removesuffix(".experts.gate_up_proj")
            out[f"{mlp}.switch_mlp.gate_proj.weight"], out[f"{mlp}.switch_mlp.up_proj.weight"] = gate, up
        elif name.endswith(".mlp.experts.down_proj"):
            out[f"{name.removesuffix('.experts.down_proj')}.switch_mlp.down_proj.weight"] = value
        else:
            out[name] = value
    for (mlp, proj), experts in sorted(per_expert.items()):
        missing = [e for e in range(num_experts) if e not in experts]
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {mlp}.experts.{missing[0]}.{proj}.weight "
                                 f"(the model has {num_experts} experts)")
        out[f"{mlp}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(num_experts)])
    return out
