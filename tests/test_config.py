"""EngineConfig's default KV pool: two whole contexts of the model, capped at min(2 GiB, 15% of RAM);
and the CLI's `--kv-cache-gb`, which overrides it."""

from __future__ import annotations

import inspect

import mlx.core as mx
import pytest
from tiny_models import tiny_args

import tinymlx_ui
from tinymlx.cli import _engine_kwargs, build_parser, main
from tinymlx.core import config as config_module
from tinymlx.core.config import EngineConfig, default_kv_cache_bytes
from tinymlx.models import read_model_args

GIB = 1 << 30
# Qwen2.5-Coder-0.5B-Instruct, the default model: 24 layers, 2 KV heads of 64, a 32,768-token context.
QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                num_key_value_heads=2, head_dim=64, vocab_size=151936, max_position_embeddings=32768)


def bytes_per_token(args, dtype: mx.Dtype) -> int:
    return 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * dtype.size


@pytest.fixture(autouse=True)
def plenty_of_ram(monkeypatch):
    """64 GiB, so only the 2 GiB cap can bind unless a test says otherwise."""
    monkeypatch.setattr(config_module, "ram_bytes", lambda: 64 * GIB)


def test_default_pool_holds_two_whole_contexts_of_the_tiny_model():
    args = tiny_args()  # 1,024-token context
    assert EngineConfig(block_size=16).resolve(args, mx.float32).num_pages == 2 * 1024 // 16
    assert EngineConfig(block_size=16, max_num_seqs=1).resolve(args, mx.float32).num_pages == 1024 // 16
    # A context that ends inside a block still gets that block, in each of the two contexts.
    assert EngineConfig(block_size=16, max_model_len=100).resolve(args, mx.float32).num_pages == 2 * 7


@pytest.mark.parametrize(("dtype", "gib"), [(mx.float32, 1.5), (mx.bfloat16, 0.75)])
def test_default_pool_of_the_default_model_is_4096_blocks(dtype, gib):
    args = tiny_args(**QWEN_05B)
    config = EngineConfig().resolve(args, dtype)
    assert config.num_pages == 4096 and config.max_model_len == 32768
    assert config.num_pages * config.block_size * bytes_per_token(args, dtype) == gib * GIB


@pytest.mark.real_model
def test_the_real_default_model_config_gives_the_same_pool(default_model_dir):
    args, _ = read_model_args(default_model_dir)
    assert EngineConfig().resolve(args, mx.float32).num_pages == 4096


def test_default_pool_is_capped_at_2_gib_and_15_percent_of_ram(monkeypatch):
    long_context = tiny_args(**{**QWEN_05B, "max_position_embeddings": 131072})  # two contexts: 6 GiB
    bytes_per_block = 16 * bytes_per_token(long_context, mx.float32)
    # A capped budget holds the activations' allowance too (core/step_memory.py); the pages get the rest.
    config = EngineConfig().resolve(long_context, mx.float32)
    assert config.num_pages == (2 * GIB - config.activation_bytes) // bytes_per_block
    monkeypatch.setattr(config_module, "ram_bytes", lambda: 4 * GIB)
    capped = int(0.15 * 4 * GIB)
    config = EngineConfig().resolve(tiny_args(**QWEN_05B), mx.float32)
    assert config.num_pages == (capped - config.activation_bytes) // bytes_per_block
    assert default_kv_cache_bytes() == capped  # the budget tensor-parallel ranks share
    monkeypatch.setattr(config_module, "ram_bytes", lambda: None)
    assert default_kv_cache_bytes() == 2 * GIB


def test_on_a_mac_gpu_the_pools_fit_the_working_set_beside_the_weights(monkeypatch):
    """Metal's max_recommended_working_set_size (a fake one here: the CPU reports none) bounds the weights and
    every pool and the activations together, a tenth of it left to the framework: the default shrinks to fit, an explicit budget
    past it is refused, never planned."""
    args = tiny_args(**QWEN_05B)
    bytes_per_block = 16 * bytes_per_token(args, mx.float32)
    monkeypatch.setattr(config_module, "working_set_bytes", lambda: 4 * GIB)
    weights = int(2.9 * GIB)
    room = int(4 * GIB * 0.9) - weights  # 0.7 GiB
    assert default_kv_cache_bytes(weights_bytes=weights) == room
    config = EngineConfig().resolve(args, mx.float32, weights_bytes=weights)
    assert config.num_pages == (room - config.activation_bytes) // bytes_per_block
    with pytest.raises(ValueError, match="do not fit this GPU's working set of 4.00 GiB"):
        EngineConfig(kv_cache_bytes=GIB).resolve(args, mx.float32, weights_bytes=weights)
    with pytest.raises(ValueError, match="max_recommended_working_set_size"):
        EngineConfig(num_pages=room // bytes_per_block + 1).resolve(args, mx.float32, weights_bytes=weights)
    with pytest.raises(ValueError, match=r"weights \(3.80 GiB\) and the KV cache's pools \(0.00 GiB\)"):
        EngineConfig().resolve(args, mx.float32, weights_bytes=int(3.8 * GIB))
    monkeypatch.setattr(config_module, "working_set_bytes", lambda: None)  # the CPU: RAM's share alone
    assert EngineConfig(kv_cache_bytes=GIB).resolve(args, mx.float32, weights_bytes=weights).num_pages == \
        GIB // bytes_per_block


def test_explicit_sizes_win_over_the_default():
    args = tiny_args(**QWEN_05B)
    assert EngineConfig(num_pages=100).resolve(args, mx.float32).num_pages == 100
    assert EngineConfig(kv_cache_bytes=3 * GIB).resolve(args, mx.float32).num_pages == 8192


def test_kv_cache_gb_flag_sets_the_pool():
    kwargs = _engine_kwargs(build_parser().parse_args(["chat", "--kv-cache-gb", "0.5"]))
    assert kwargs["kv_cache_bytes"] == GIB // 2 and kwargs["num_pages"] is None
    assert EngineConfig(**kwargs).resolve(tiny_args(**QWEN_05B), mx.float32).num_pages == 4096 // 3
    assert _engine_kwargs(build_parser().parse_args(["chat"]))["kv_cache_bytes"] is None
    inspect.signature(tinymlx_ui.run_chat).bind(**kwargs)  # `tinymlx chat` passes them all on


@pytest.mark.parametrize("argv", [["--kv-cache-gb", "0"], ["--kv-cache-gb", "-1"], ["--kv-cache-gb", "lots"],
                                  ["--kv-cache-gb", "1", "--num-pages", "64"]])
def test_bad_kv_cache_gb_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *argv])
    assert exit_info.value.code == 2 and "--kv-cache-gb" in capsys.readouterr().err


@pytest.mark.parametrize("code", [0, 2])
def test_chat_command_exits_with_the_apps_code(code, monkeypatch):
    calls = []
    monkeypatch.setattr(tinymlx_ui, "run_chat", lambda **kwargs: calls.append(kwargs) or code)
    if code:
        with pytest.raises(SystemExit) as exit_info:
            main(["chat", "--model", "/nonexistent", "--kv-cache-gb", "1"])
        assert exit_info.value.code == code
    else:
        main(["chat", "--model", "/nonexistent", "--kv-cache-gb", "1"])
    assert calls[0]["model"] == "/nonexistent" and calls[0]["kv_cache_bytes"] == GIB
