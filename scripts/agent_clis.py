"""The agent CLIs people point at a local server, pinned, installed once per machine, and run
non-interactively against a tinymlx server on loopback: Claude Code, Codex CLI, opencode and aider.

    python scripts/agent_clis.py install        # into $TINYMLX_AGENT_CLIS or ~/.cache/tinymlx/agent-clis
    python scripts/agent_clis.py paths          # where each one's executable is

Each is set up exactly as the README's agent section says (one environment line or flag set per CLI),
plus what keeps it on loopback and off its vendor's telemetry. Used by tests/test_agent_clis.py and
benchmarks/agent_clis.py. Standard library only: scripts/test runs the install before pytest.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pin:
    registry: str  # "npm" | "pypi"
    package: str
    version: str
    command: str


PINS = {
    "claude": Pin("npm", "@anthropic-ai/claude-code", "2.1.328", "claude"),
    "codex": Pin("npm", "@openai/codex", "0.169.0", "codex"),
    "opencode": Pin("npm", "opencode-ai", "1.18.33", "opencode"),
    "aider": Pin("pypi", "aider-chat", "0.86.2", "aider"),
}


def cache_dir() -> Path:
    if os.environ.get("TINYMLX_AGENT_CLIS"):
        return Path(os.environ["TINYMLX_AGENT_CLIS"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tinymlx" / "agent-clis"


def executable(name: str, root: Path | None = None) -> Path:
    pin, home = PINS[name], (root or cache_dir()) / name
    return home / ("venv/bin" if pin.registry == "pypi" else "node_modules/.bin") / pin.command


def is_installed(name: str, root: Path | None = None) -> bool:
    marker = (root or cache_dir()) / name / ".pinned"
    return executable(name, root).exists() and marker.is_file() and marker.read_text() == PINS[name].version


def install(names: tuple[str, ...] = tuple(PINS), root: Path | None = None, log=print) -> dict[str, Path]:
    """Installs the pinned CLIs that are missing (npm for three, a venv for aider); one process at a time."""
    root = root or cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in names:
            if is_installed(name, root):
                continue
            pin, home = PINS[name], root / name
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            log(f"installing {pin.package}=={pin.version} (once per machine) ...")
            started = time.monotonic()
            if pin.registry == "npm":
                if shutil.which("npm") is None:
                    raise RuntimeError(f"{pin.package} needs npm (Node.js 18 or newer) to install")
                _run(["npm", "install", "--prefix", str(home), "--no-audit", "--no-fund", "--loglevel=error",
                      f"{pin.package}@{pin.version}"], home / "install.log")
            else:
                _run([sys.executable, "-m", "venv", str(home / "venv")], home / "install.log")
                _run([str(home / "venv/bin/python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                      f"{pin.package}=={pin.version}"], home / "install.log")
            (home / ".pinned").write_text(pin.version)
            log(f"installed {pin.package}=={pin.version} in {time.monotonic() - started:.0f} s")
    return {name: executable(name, root) for name in names}


def _run(argv: list[str], log_path: Path) -> None:
    with open(log_path, "a") as log_file:
        done = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({done.returncode}); see {log_path}")


# -- running one ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finished:
    name: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float


@dataclass(frozen=True)
class Invocation:
    env: dict[str, str]
    args: list[str]


def setup(name: str, base_url: str, model: str, small_model: str | None = None) -> Invocation:
    """How a user points the CLI at the server: the README's line for it."""
    base_url, small_model = base_url.rstrip("/"), small_model or model
    if name == "claude":
        # Every model alias Claude Code may ask for (its subagents name opus, sonnet or haiku) is served.
        return Invocation({"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_AUTH_TOKEN": "unused", "ANTHROPIC_MODEL": model,
                           "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                           "ANTHROPIC_DEFAULT_HAIKU_MODEL": small_model}, [])
    if name == "codex":
        provider = f'{{name="tinymlx", base_url="{base_url}/v1", wire_api="responses"}}'
        return Invocation({}, ["-c", "model_provider=tinymlx", "-c", f"model_providers.tinymlx={provider}",
                               "-m", model])
    if name == "opencode":
        config = {"provider": {"tinymlx": {"npm": "@ai-sdk/openai-compatible",
                                           "options": {"baseURL": f"{base_url}/v1", "apiKey": "unused"},
                                           "models": {name: {} for name in dict.fromkeys((model, small_model))}}},
                  "model": f"tinymlx/{model}", "small_model": f"tinymlx/{small_model}"}
        return Invocation({"OPENCODE_CONFIG_CONTENT": json.dumps(config, separators=(",", ":"))}, [])
    return Invocation({}, ["--openai-api-base", f"{base_url}/v1", "--openai-api-key", "unused",
                           "--model", f"openai/{model}"])


def readme_line(name: str, base_url: str, model: str, small_model: str | None = None) -> str:
    invocation = setup(name, base_url, model, small_model)
    words = [f"{key}={shlex.quote(value)}" for key, value in invocation.env.items()]
    return " ".join([*words, PINS[name].command, *map(shlex.quote, invocation.args)])


class AgentCLIs:
    """Runs the installed CLIs, set up as the README says, against the server at `base_url` serving
    `model` (and `small_model`, for Claude Code's side requests). `home` is a scratch HOME: sessions,
    settings and logs land there, never in the user's own. Beyond the README's lines, each run is made
    non-interactive, and quiet: no telemetry, update checks or downloads (only loopback is reachable)."""

    def __init__(self, base_url: str, model: str, home: Path, small_model: str | None = None,
                 root: Path | None = None):
        self.base_url, self.model, self.small_model = base_url.rstrip("/"), model, small_model or model
        self.home, self.root = home, root
        home.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, prompt: str, workdir: Path, *, resume: bool = False, timeout_s: float = 600,
            flags: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Finished:
        """One non-interactive run in `workdir`; `resume` continues that CLI's last session there. `flags`
        go after the README's line (Codex's before its exec), `env` over the rest."""
        invocation = setup(name, self.base_url, self.model, self.small_model)
        quiet_env, batch = getattr(self, f"_{name}")(prompt, resume)
        argv = [str(executable(name, self.root)), *invocation.args, *flags, *batch]
        env = {**self._base_env(), **invocation.env, **quiet_env, **(env or {})}
        started = time.monotonic()
        done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, check=False)
        return Finished(name, done.returncode, done.stdout, done.stderr, time.monotonic() - started)

    def _base_env(self) -> dict[str, str]:
        keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SSL_CERT_FILE")
        return {**{k: os.environ[k] for k in keep if k in os.environ}, "HOME": str(self.home), "NO_COLOR": "1"}

    # (what keeps each quiet, its non-interactive arguments)
    def _claude(self, prompt: str, resume: bool) -> tuple[dict[str, str], list[str]]:
        env = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"}
        return env, ["-p", prompt, "--output-format", "json", *(["--continue"] if resume else [])]

    def _codex(self, prompt: str, resume: bool) -> tuple[dict[str, str], list[str]]:
        quiet = ["-c", "check_for_update_on_startup=false", "-c", "features.plugins=false",
                 "-c", "analytics.enabled=false", "--skip-git-repo-check"]
        return {}, ["exec", *quiet, *(["resume", "--last"] if resume else []), prompt]

    def _opencode(self, prompt: str, resume: bool) -> tuple[dict[str, str], list[str]]:
        env = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
               "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1",
               "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}
        return env, ["run", prompt, *(["--continue"] if resume else [])]

    def _aider(self, prompt: str, resume: bool) -> tuple[dict[str, str], list[str]]:
        # Without the metadata file aider fetches litellm's model price list from GitHub at start.
        metadata = self.home / "aider-model-metadata.json"
        metadata.write_text(json.dumps({f"openai/{self.model}": {
            "max_tokens": 8192, "max_input_tokens": 32768, "max_output_tokens": 8192, "input_cost_per_token": 0,
            "output_cost_per_token": 0, "litellm_provider": "openai", "mode": "chat"}}))
        return {}, ["--message", prompt, "--model-metadata-file", str(metadata), "--yes-always", "--no-check-update",
                    "--no-show-model-warnings", "--analytics-disable", "--no-show-release-notes", "--no-pretty",
                    *(["--restore-chat-history"] if resume else [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("install", "paths"))
    parser.add_argument("names", nargs="*", default=list(PINS), help=f"which ({', '.join(PINS)}; default all)")
    args = parser.parse_args()
    names = tuple(args.names)
    if args.action == "install":
        install(names)
    for name in names:
        print(f"{name}\t{PINS[name].package}=={PINS[name].version}\t{executable(name)}"
              f"{'' if is_installed(name) else '  (not installed)'}")


if __name__ == "__main__":
    main()
