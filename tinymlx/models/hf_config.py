"""Reading config.json as transformers 4.x and 5.x both write it, into one normalized form.

    4.x: rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern
    5.x: rope_parameters (flat, or keyed by layer type: {"full_attention": {...}, "sliding_attention": {...}}),
         layer_types
    ->   rope_theta + rope_scaling (None: plain RoPE) for each layer type, and a layer_types tuple

A missing key a family needs raises KeyError naming it; the loader turns that into a ModelLoadError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"
_ROPE_KEYS_NOT_SCALING = ("rope_theta", "rope_type", "type")


def rope_for(config: dict[str, Any], layer_type: str, default_theta: float,
             theta_key: str = "rope_theta") -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of `layer_type`'s RoPE; scaling is None for plain RoPE, else a dict with `rope_type`.

    `theta_key` is where 4.x keeps this layer type's base (Gemma 3's local layers: rope_local_base_freq)."""
    params = config.get("rope_parameters")
    if params is not None:  # 5.x
        if FULL in params or SLIDING in params:
            params = params.get(layer_type) or params.get(FULL)
        return params.get("rope_theta", default_theta), _scaling(params)
    theta = config.get(theta_key, default_theta)
    # 4.x: rope_scaling belongs to the global (full) layers; Gemma 3's local layers run plain RoPE.
    return theta, _scaling(config.get("rope_scaling")) if theta_key == "rope_theta" else None


def _scaling(params: dict[str, Any] | None) -> dict[str, Any] | None:
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    rest = {k: v for k, v in params.items() if k not in _ROPE_KEYS_NOT_SCALING}
    return {"rope_type": kind, **rest}


def layer_types(config: dict[str, Any], default: Callable[[int], str]) -> tuple[str, ...]:
    """Each layer's type: 5.x lists them; 4.x leaves them to the family's rule, `default(layer)`."""
    num_layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        return tuple(default(i) for i in range(num_layers))
    if len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, num_hidden_layers is {num_layers}")
    return tuple(types)


def qwen_layer_types(config: dict[str, Any]) -> tuple[str, ...]:
    """Qwen2/Qwen3: with use_sliding_window, the layers from max_window_layers on attend over a window."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    first_sliding = config.get("max_window_layers", 28)
    return layer_types(config, lambda i: SLIDING if window is not None and i >= first_sliding else FULL)


def sliding_window(config: dict[str, Any], types: tuple[str, ...]) -> int | None:
    """The window of the sliding layers (None when there are none)."""
    if SLIDING not in types:
        return None
    return config["sliding_window"]


def first_of(config: dict[str, Any], *keys: str) -> Any:
    """The value of the first of `keys` present (names differ between transformers versions)."""
    for key in keys:
        if key in config:
            return config[key]
    raise KeyError(keys[0])


def dense_shape(config: dict[str, Any]) -> dict[str, int]:
    """The sizes of a dense decoder, as config.json names them: widths, depth, vocabulary and heads."""
    return dict(
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        **heads(config),
    )


def heads(config: dict[str, Any]) -> dict[str, int]:
    """The attention shape every family shares."""
    num_heads = config["num_attention_heads"]
    return dict(
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
    )
