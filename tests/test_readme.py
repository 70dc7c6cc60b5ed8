"""Every Python block of the README runs as written, each in a fresh process, within a memory bound.

A block that talks to `tinymlx serve` runs against one this module starts; it listens on a free
loopback port, written into the block in place of the README's 8321 (which may be taken). A block's
peak RSS is that of its whole process tree, the tensor-parallel ranks included.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
from server_harness import free_port

from tinymlx.core.speculative_config import SpeculativeConfig
from tinymlx.loader import OFFLINE_MODELS

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
README_PORT = "8321"
GB = 1e9

# Peak RSS bounds for float32 weights on the CPU, as CI runs (a Mac's bfloat16 needs less). Measured on a
# 2-core Linux box: an engine of the default 0.5B model peaked at 2.7-3.0 GB (the Python API, speculative
# and structured-output blocks, and the server); the TP block's two ranks at 3.7 GB together (1.85 each), the
# pipeline block's two stages at 3.2 GB together; an API client, the Agents SDK's too, at 0.13 GB. Two engines
# alive at once, as the README's old speculative block had them, peaked at 5.3 GB.
ENGINE_PEAK_GB = 4.0
PARALLEL_PEAK_GB = 5.0  # two ranks: tensor or pipeline parallel
CLIENT_PEAK_GB = 0.4
BLOCK_TIMEOUT_S = 300
POLL_S = 0.05


class ReadmeBlock(NamedTuple):
    name: str  # the section heading's first words, as a test id
    line: int  # README's line of the block's first code line
    source: str

    @property
    def is_client(self) -> bool:
        return f"127.0.0.1:{README_PORT}" in self.source

    @property
    def peak_bound_gb(self) -> float:
        if self.is_client:
            return CLIENT_PEAK_GB
        is_parallel = "tensor_parallel_size" in self.source or "pipeline_parallel_size" in self.source
        return PARALLEL_PEAK_GB if is_parallel else ENGINE_PEAK_GB


class BlockRun(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    peak_rss_bytes: int
    seconds: float


def readme_python_blocks(readme: str) -> list[ReadmeBlock]:
    blocks: list[ReadmeBlock] = []
    for match in re.finditer(r"^```python\n(.*?)^```", readme, flags=re.DOTALL | re.MULTILINE):
        headings = re.findall(r"^#{2,3} (.*)$", readme[:match.start()], flags=re.MULTILINE)
        name = "-".join(re.findall(r"[a-z0-9]+", headings[-1].lower())[:3])
        if any(b.name == name for b in blocks):  # a second block in one section
            name += f"-{len(blocks) + 1}"
        blocks.append(ReadmeBlock(name, readme.count("\n", 0, match.start(1)) + 1, match[1]))
    return blocks


BLOCKS = readme_python_blocks(README)


def _block(marker: str) -> ReadmeBlock:
    (block,) = [b for b in BLOCKS if marker in b.source]
    return block


def _tree_rss_bytes(root: int) -> tuple[int, int]:
    """(the summed RSS of `root` and its descendants, the largest VmHWM among them), read from /proc.
    VmHWM is each process's own high-water mark since its exec: it catches a peak between two polls.
    (wait4's ru_maxrss would not do: a child forked from this test process counts its RSS before exec.)"""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    tree, frontier = set(), {root}
    while frontier:
        tree |= frontier
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - tree
    total = high_water = 0
    for pid in tree:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    high_water = max(high_water, int(line.split()[1]) * 1024)
    return total, high_water


def run_measured(command: list[str], cwd: Path) -> BlockRun:
    """Run `command` to its end. Its peak RSS: the largest sum over its process tree, or the largest
    high-water mark of one process in it, seen every POLL_S."""
    start = time.monotonic()
    with open(cwd / "stdout", "w+") as out, open(cwd / "stderr", "w+") as err:
        process = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=err, start_new_session=True)
        peak = 0
        while process.poll() is None:
            if time.monotonic() - start > BLOCK_TIMEOUT_S:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            peak = max(peak, *_tree_rss_bytes(process.pid))
            time.sleep(POLL_S)
        out.seek(0)
        err.seek(0)
        return BlockRun(process.returncode, out.read(), err.read(), peak, time.monotonic() - start)


class ServeProcess(NamedTuple):
    process: subprocess.Popen
    port: int

    def peak_rss_bytes(self) -> int:
        """The server's peak RSS so far (VmHWM); 0 where /proc is missing."""
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return 0


@pytest.fixture(scope="module")
def serve(default_gguf, tmp_path_factory):
    """`tinymlx serve` as the README starts it, with the default model, on a free loopback port."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "log"
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "tinymlx.cli", "serve", "--port", str(port)],
                                   stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while True:
            assert process.poll() is None and time.monotonic() < deadline, f"no server: {log.read_text()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            time.sleep(0.2)
        yield ServeProcess(process, port)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.mark.real_model
@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_readme_python_block_runs_as_written(block, default_gguf, request, tmp_path):
    source = block.source
    if block.is_client:
        server = request.getfixturevalue("serve")
        source = source.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{server.port}")
    if "json_schema=schema" in source:  # to check the answer the block's comment claims
        source += "print(out[0].text)\n"
    # Blank lines first, so a traceback's line numbers are the README's (a NameError is the README's bug).
    script = tmp_path / "readme_block.py"
    script.write_text("\n" * (block.line - 1) + source)
    run = run_measured([sys.executable, str(script)], tmp_path)
    print(f"README block {block.name}: peak RSS {run.peak_rss_bytes / GB:.2f} GB, {run.seconds:.1f} s")

    assert run.returncode == 0, f"exit status {run.returncode} after {run.seconds:.0f} s:\n{run.stderr}"
    assert run.stdout.strip(), "the block printed nothing"
    assert run.peak_rss_bytes < block.peak_bound_gb * GB, f"{run.peak_rss_bytes / GB:.2f} GB"
    if block.is_client:
        server_peak = server.peak_rss_bytes()
        print(f"  the server's peak RSS so far: {server_peak / GB:.2f} GB")
        assert server_peak < ENGINE_PEAK_GB * GB
    if "json_schema=schema" in source:  # the comment shows what the model answers
        claimed = re.search(r"json\.loads\(out\[0\]\.text\)\s+# (.*)", block.source)[1]
        assert json.loads(run.stdout) == json.loads(claimed)  # the only thing it prints


def test_readme_speculative_alternatives_are_valid():
    """The speculative block runs one proposer; the specs it shows in comments (options string included)
    must parse too, and name offline models."""
    block = _block('speculative="ngram"')
    quoted = re.findall(r'"((?:ngram|draft|ngram\+draft)(?::[^"]*)?)"', block.source)
    specs = [SpeculativeConfig.parse(spec) for spec in quoted]
    assert {spec.method for spec in specs} == {"ngram", "draft", "ngram+draft"}
    assert any(spec.max_draft_tokens == 8 and not spec.adaptive for spec in specs)  # the options string
    models = re.findall(r'LLM\("([^"]+)"', block.source) + [s.draft_model for s in specs if s.draft_model]
    assert models and set(models) <= set(OFFLINE_MODELS)
