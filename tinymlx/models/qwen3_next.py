"""Qwen3-Next: Qwen3.5's hybrid layers (qwen3_5.py) with a mixture of experts plus a gated shared expert
in every sparse layer, and its Gated DeltaNet's four input projections fused into two.

The fused projections interleave per key head: in_proj_qkvz's rows are, for each key head h,
[q_h (Dk), k_h (Dk), v of its r value heads (r Dv), z of them (r Dv)] (r = value heads per key head);
in_proj_ba's are [b of its r value heads, a of them]. `sanitize` regroups the rows into Qwen3.5's
in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (a quantized weight's scales and biases alike), so
one module tree runs both.
"""

from __future__ import annotations

import mlx.core as mx

from tinymlx.models import qwen3_5

ModelArgs = qwen3_5.ModelArgs


class Model(qwen3_5.Model):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        args = self.args
        hk, dk, dv = args.linear_num_key_heads, args.linear_key_head_dim, args.linear_value_head_dim
        r = args.linear_num_value_heads // hk
        split = {}
        for name, value in weights.items():
            prefix, _, suffix = name.rpartition(".")  # suffix: weight, scales or biases
            if prefix.endswith("linear_attn.in_proj_qkvz"):
                q, k, v, z = _per_key_head(value, hk, [dk, 2 * dk, 2 * dk + r * dv])
                base = prefix.removesuffix("in_proj_qkvz")
                split[f"{base}in_proj_qkv.{suffix}"] = mx.concatenate([q, k, v])
                split[f"{base}in_proj_z.{suffix}"] = z
            elif prefix.endswith("linear_attn.in_proj_ba"):
                b, a = _per_key_head(value, hk, [r])
                base = prefix.removesuffix("in_proj_ba")
                split[f"{base}in_proj_b.{suffix}"], split[f"{base}in_proj_a.{suffix}"] = b, a
            else:
                split[name] = value
        return super().sanitize(split)


def _per_key_head(rows: mx.array, num_key_heads: int, cuts: list[int]) -> list[mx.array]:
    """Split every key head's block of rows at `cuts`, each part's rows gathered over the heads."""
    blocks = rows.reshape(num_key_heads, -1, *rows.shape[1:])
    return [part.reshape(-1, *rows.shape[1:]) for part in mx.split(blocks, cuts, axis=1)]
