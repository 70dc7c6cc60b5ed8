"""The install sets: running tinymlx installs no test or benchmark packages (torch alone is 750 MB).

The scripts run for real on a copy of scripts/ and pyproject.toml, with stubs for the venv's python and
tinymlx (and apt-get, sudo) that only record how they were called: nothing is installed or downloaded.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
HEAVY = {"torch", "transformers", "accelerate", "mlx-lm", "matplotlib"}


def _requirements(extra: str | None = None) -> set[str]:
    """Distribution names an install pulls in from pyproject.toml: the base dependencies plus `extra`'s."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[A-Za-z0-9._-]+", dep)[0].lower() for dep in project["dependencies"]}
    for dep in project["optional-dependencies"].get(extra, []) if extra else []:
        nested = re.fullmatch(r"tinymlx\[([\w,]+)\]", dep)
        if nested:
            names |= set().union(*(_requirements(e) for e in nested[1].split(",")))
        else:
            names.add(re.match(r"[A-Za-z0-9._-]+", dep)[0].lower())
    return names


def test_running_needs_no_test_or_benchmark_packages():
    assert not _requirements() & HEAVY
    assert not _requirements("serve") & HEAVY  # `scripts/tinymlx serve` installs the serve extra
    assert {"torch", "transformers", "pytest"} <= _requirements("test")
    assert {"mlx-lm", "matplotlib", "outlines-core"} <= _requirements("bench")
    assert _requirements("test") | _requirements("bench") | {"ruff"} == _requirements("dev")


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """scripts/ and pyproject.toml in a fresh directory, with a stub venv and stub system tools."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for stub in [".venv/bin/python", ".venv/bin/tinymlx", "stubs/apt-get", "stubs/sudo"]:
        path = tmp_path / stub
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('#!/usr/bin/env bash\necho "$(basename "$0") $*" >> "$CALLS"\n')
        path.chmod(0o755)
    return tmp_path


def _run(clone: Path, script: str, *args: str) -> list[str]:
    """The stubbed commands `scripts/<script> args` ran, one line each."""
    calls = clone / "calls.log"
    calls.write_text("")
    env = {**os.environ, "CALLS": str(calls), "PATH": f"{clone / 'stubs'}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(clone / "scripts" / script), *args], env=env, check=True, timeout=30)
    return calls.read_text().splitlines()


def _installs(calls: list[str]) -> list[str]:
    return [call.split(" -e ", 1)[1] for call in calls if " -m pip install " in call]


def test_the_main_command_installs_tinymlx_alone_and_once(clone):
    calls = _run(clone, "tinymlx", "chat")
    assert _installs(calls) == [str(clone)]  # `pip install -e .`: no extras
    assert calls[-1] == "tinymlx chat" and "tinymlx models fetch" not in calls  # it downloads on its loading screen
    assert _installs(_run(clone, "tinymlx", "generate", "hi")) == []  # the stamp: set up once
    assert _installs(_run(clone, "tinymlx", "serve")) == [f"{clone}[serve]"]


def test_the_test_command_installs_the_test_extra_and_reinstalls_when_pyproject_changes(clone):
    assert _installs(_run(clone, "tinymlx", "chat")) == [str(clone)]
    calls = _run(clone, "test", "-q")
    assert _installs(calls) == [f"{clone}[test]"]
    # the tests' shared model and the agent CLIs they run, installed first
    assert calls[-3:] == ["tinymlx models fetch", "python scripts/agent_clis.py install", "python -m pytest -q"]
    assert _installs(_run(clone, "test")) == []
    future = (clone / "pyproject.toml").stat().st_mtime + 60
    os.utime(clone / "pyproject.toml", (future, future))
    assert _installs(_run(clone, "test")) == [f"{clone}[test]"]
    assert _installs(_run(clone, "tinymlx", "chat")) == [str(clone)]


def test_pip_chatter_stays_in_the_log_unless_the_install_fails(clone):
    noisy = '#!/usr/bin/env bash\necho "$(basename "$0") $*" >> "$CALLS"\necho "BuildBackendWarning: noise" >&2\n'
    python = clone / ".venv/bin/python"
    python.write_text(noisy)
    env = {**os.environ, "CALLS": str(clone / "calls.log"), "PATH": f"{clone / 'stubs'}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(clone / "scripts/tinymlx"), "chat"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0 and "noise" not in run.stdout + run.stderr
    assert "noise" in (clone / ".venv-install.log").read_text()
    python.write_text(noisy + 'case "$*" in *"pip install"*) exit 1;; esac\n')
    run = subprocess.run(["bash", str(clone / "scripts/test")], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 1 and "the install failed" in run.stderr and "BuildBackendWarning: noise" in run.stderr
