"""A checkpoint's multi-token-prediction head (Qwen3.5 / 3.6, Qwen3-Next: `mtp.*`), as a model of its own
that speculative decoding drafts with (speculative/mtp.py).

    at position p:  e = pre_fc_norm_embedding(embed(x_{p+1}))    h = pre_fc_norm_hidden(h_p)
                    out = norm(layer(fc([e, h])))  -> lm_head -> a guess for x_{p+2}

h_p is the target's final hidden state at p (after its last norm: what its lm_head scores), and the head's
own output stands in for h_{p+1} when it drafts on from its own guess. The layers are full-attention decoder
layers of the family; with several, draft depth d runs layer d mod n (the first, over real hidden states,
runs layer 0). The embedding and the lm_head are the target's own, shared, never copied.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from tinymlx.core.layer_specs import FullAttention, LayerSpec
from tinymlx.models.base import AttentionBackend, CausalLM
from tinymlx.models.layers import RMSNorm


class HeadInput(NamedTuple):
    """What the head reads beside its tokens: each token's hidden state [N, hidden] and the draft depth."""

    hidden: mx.array
    depth: int = 0


class MTPBody(nn.Module):
    """The head's own weights, named as the checkpoint names them under `mtp.`."""

    def __init__(self, hidden_size: int, eps: float, layers: list[nn.Module]):
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden_size, eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden_size, eps)
        self.layers = layers
        self.norm = RMSNorm(hidden_size, eps)

    def __call__(self, embedded: mx.array, positions: mx.array, attention: AttentionBackend, rows: mx.array | None,
                 context: HeadInput) -> mx.array:
        hidden = self.pre_fc_norm_hidden(context.hidden.astype(embedded.dtype))
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embedded), hidden], axis=-1))
        layer = self.layers[context.depth % len(self.layers)]
        return self.norm(layer(x, positions, attention, rows))


class MTPModel(CausalLM):
    """The head with the target's embedding and lm_head, run by a ModelRunner of its own (its own KV pool,
    addressed by the target's full-attention block tables)."""

    def __init__(self, target: CausalLM, body: MTPBody):
        super().__init__(replace(target.args, num_hidden_layers=len(body.layers), layer_types=()))
        self.model = body
        body.embed_tokens = target.model.embed_tokens  # shared: the dtype K/V takes is the target's (activation_dtype)
        object.__setattr__(self, "_target_logits", target.logits)  # a bound method, not a child module

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        return (FullAttention(),) * self.args.num_hidden_layers

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None, context: HeadInput | None = None) -> mx.array:
        assert context is not None, "the MTP head reads the target's hidden states"
        return self.model(self.model.embed_tokens(tokens), positions, attention, rows, context)

    def logits(self, hidden: mx.array) -> mx.array:
        return self._target_logits(hidden)
