"""Building a Model from a HF-format directory: dtypes, MLX-quantized checkpoints, bad files."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny_models import dense_logits, save_dir, tiny_model

from tinymlx.loader import ModelLoadError
from tinymlx.models import load_model
from tinymlx.ops.cpu.linear import LINEAR_LAYOUT_ENV, CPULinear, use_cpu_linears

TOKENS = np.random.default_rng(0).integers(0, 256, 24).tolist()


def rel_err(a: mx.array, b: mx.array) -> float:
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_float32_directory_loads_exactly(tmp_path):
    model = tiny_model(seed=1)
    loaded = load_model(save_dir(tmp_path / "m", model), dtype="float32")
    # On the CPU every float linear is the CPU's (tests pin its [in, out] layout): same numbers, other layout.
    expected = CPULinear if mx.default_device() == mx.cpu else nn.Linear
    assert type(loaded.lm_head) is expected and type(loaded.model.layers[0].self_attn.q_proj) is expected
    assert "bias" in loaded.model.layers[0].self_attn.q_proj
    assert mx.allclose(dense_logits(loaded, TOKENS), dense_logits(model, TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the float32 BLAS layout is the CPU's")
@pytest.mark.parametrize("layout", [None, "input_major", "hf"])
def test_each_weight_shape_takes_the_layout_measured_faster(tmp_path, monkeypatch, layout):
    """Unpinned, each float weight shape keeps the layout that multiplied a batch of rows faster at load (timed
    here, as on a user's machine); pinned, every one takes the pinned layout. The logits are the same either way."""
    if layout is None:
        monkeypatch.delenv(LINEAR_LAYOUT_ENV)
    else:
        monkeypatch.setenv(LINEAR_LAYOUT_ENV, layout)
    model = tiny_model(seed=1)
    loaded = load_model(save_dir(tmp_path / "m", model), dtype="float32")
    shapes = {m.weight.shape for _, m in tiny_model(seed=1).named_modules() if type(m) is nn.Linear}
    chosen = use_cpu_linears(tiny_model(seed=1))
    assert set(chosen) == shapes  # each shape timed once
    if layout is not None:
        assert set(chosen.values()) == {layout == "input_major"}
    linears = [m for _, m in loaded.named_modules() if isinstance(m, (nn.Linear, CPULinear))]
    assert {type(m) for m in linears} == {CPULinear}
    if layout is not None:  # unpinned, a shape's timing at load may differ from the one above
        assert {m.input_major for m in linears} == {layout == "input_major"}
    assert mx.allclose(dense_logits(loaded, TOKENS), dense_logits(model, TOKENS), rtol=1e-5, atol=1e-5)


def test_a_pinned_layout_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv(LINEAR_LAYOUT_ENV, "column")
    with pytest.raises(ValueError, match="TINYMLX_LINEAR_LAYOUT must be one of"):
        load_model(save_dir(tmp_path / "m", tiny_model(seed=1)), dtype="float32")


@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 0.05), ("float16", 0.01), ("q8", 0.05), ("q4", 0.6)])
def test_selectable_dtypes_stay_close_to_float32(tmp_path, dtype, tolerance):
    model = tiny_model(seed=2, hidden_size=128, intermediate_size=256)  # q4 needs groups of 64
    reference = dense_logits(model, TOKENS)
    loaded = load_model(save_dir(tmp_path / "m", model), dtype=dtype)
    q_proj = loaded.model.layers[0].self_attn.q_proj
    if dtype.startswith("q"):
        assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.bits == int(dtype[1:])
        nn.quantize(model, group_size=64, bits=int(dtype[1:]))  # the same re-quantization, done by hand
        assert mx.allclose(dense_logits(loaded, TOKENS), dense_logits(model, TOKENS), atol=1e-5)
    else:
        assert q_proj.weight.dtype == getattr(mx, dtype)
    assert rel_err(dense_logits(loaded, TOKENS), reference) < tolerance


def test_mlx_quantized_checkpoint_loads_as_published(tmp_path):
    model = tiny_model(seed=3, hidden_size=128, intermediate_size=256)
    nn.quantize(model, group_size=64, bits=4)
    path = save_dir(tmp_path / "q", model, {"quantization": {"group_size": 64, "bits": 4}})
    loaded = load_model(path, dtype="auto")
    assert isinstance(loaded.model.layers[1].mlp.down_proj, nn.QuantizedLinear)
    assert mx.allclose(dense_logits(loaded, TOKENS), dense_logits(model, TOKENS), atol=1e-5)


def test_unsupported_architecture_is_refused(tmp_path):
    path = save_dir(tmp_path / "m", tiny_model(), {"model_type": "gpt_neox"})
    with pytest.raises(ModelLoadError, match="gpt_neox.*not supported"):
        load_model(path)


def test_missing_weights_are_refused(tmp_path):
    path = save_dir(tmp_path / "m", tiny_model(), drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ModelLoadError, match="do not match"):
        load_model(path)
