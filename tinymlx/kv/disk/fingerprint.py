"""A model's fingerprint: what must match for a stored K/V block or state checkpoint to be reused by this engine.

K/V depend on the architecture (the config), the weights and their dtype, and how the pool stores them
(the KV layout, the block size, the KV heads); the state pools' checkpoints on their states' layouts too
(a hybrid model's recurrent state shapes: kv/state_pool.py `StatePool.layout`). The weights enter through
a sample of each tensor's values (1,024 evenly spaced ones) with its name, shape and dtype: reading every
weight would cost seconds for a large model at start, and a fine-tune changes far more values than the
sample misses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from tinymlx.core.kv_layout import KVLayout
from tinymlx.models import CausalLM

_SAMPLES_PER_TENSOR = 1024


def layout_text(layout: KVLayout, num_kv_heads: int, block_size: int) -> str:
    """The KV layout in words (block files carry it in their header)."""
    return (f"kv_cache_dtype={layout.kv_cache_dtype} activations={layout.dtype} head_dim={layout.head_dim} "
            f"kv_heads={num_kv_heads} block_size={block_size}")


def model_fingerprint(model: CausalLM, layout: KVLayout, block_size: int, state_layouts: tuple[str, ...] = ()) -> str:
    """32 hex digits, the same in every process that loads the same weights the same way. `state_layouts`:
    the state pools' (StatePool.layout)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(dataclasses.asdict(model.args), sort_keys=True, default=repr).encode())
    digest.update(repr(model.layer_specs()).encode())
    digest.update(layout_text(layout, model.num_local_kv_heads, block_size).encode())
    digest.update("".join(state_layouts).encode())  # b"" without state pools: dense models' fingerprints stay
    params = sorted((_logical(name, array) for name, array in tree_flatten(model.parameters())), key=lambda item: item[0])
    samples = [_sample(array) for _, array in params]
    mx.eval(samples)
    for (name, array), sample in zip(params, samples):
        digest.update(f"{name} {tuple(array.shape)} {array.dtype}".encode())
        digest.update(np.array(sample).tobytes())
    return digest.hexdigest()


def _logical(name: str, array: mx.array) -> tuple[str, mx.array]:
    """A weight as checkpoints hold it: the CPU's linears keep some input-major (`weight_t`, ops/cpu/linear.py),
    in whichever layout a timing at load preferred, which two processes may choose differently."""
    return (name.removesuffix("_t"), array.T) if name.endswith(".weight_t") else (name, array)


def _sample(array: mx.array) -> mx.array:
    flat = array.reshape(-1)
    index = np.linspace(0, flat.size - 1, min(flat.size, _SAMPLES_PER_TENSOR)).astype(np.uint32)
    return flat[mx.array(index)].view(mx.uint8)  # the bits, whatever the dtype (bfloat16 has no NumPy twin)
