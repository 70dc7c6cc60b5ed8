"""Shared by the serving benchmarks: a server in its own process, and streamed requests over loopback.

Every request streams (SSE), so the client sees the first token and every later one as they come;
times count from the run's start. Servers bind 127.0.0.1 only and every loop is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np


@dataclass
class RequestResult:
    sent_s: float  # since the run's start
    status: int = 0
    code: str | None = None  # the error code of a refused or failed request
    retry_after: str | None = None
    ttft_s: float | None = None  # sent -> first token
    e2e_s: float | None = None  # sent -> last event
    num_tokens: int = 0  # from the usage chunk
    token_times_s: list[float] = field(default_factory=list)  # since sent, one per content chunk

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.code is None

    @property
    def itl_s(self) -> list[float]:
        return list(np.diff(self.token_times_s))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """`tinymlx serve` or `mlx_lm.server` on a free loopback port, for the length of a `with` block."""

    def __init__(self, command: list[str], port: int, name: str, model: str, log_path: Path | None = None):
        self.command, self.port, self.name, self.model = command, port, name, model
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path  # the server's output (its per-request log lines); None: dropped
        self._process: subprocess.Popen | None = None

    @classmethod
    def tinymlx(cls, model_dir: Path, *flags: str) -> ServerProcess:
        port = free_port()
        command = [sys.executable, "-m", "tinymlx.cli", "serve", "--model", str(model_dir), "--port", str(port),
                   "--served-model-name", "bench", *flags]
        return cls(command, port, "tinymlx", "bench")

    @classmethod
    def mlx_lm(cls, model_dir: Path, *flags: str) -> ServerProcess:
        port = free_port()
        command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port), *flags]
        return cls(command, port, "mlx-lm", "default_model")  # mlx-lm's name for its --model

    def __enter__(self) -> ServerProcess:
        self._log = open(self.log_path or os.devnull, "w")  # noqa: SIM115 - closed in __exit__
        self._process = subprocess.Popen(self.command, stdout=self._log, stderr=self._log)
        deadline = time.monotonic() + 300
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self._process.returncode}: {self.command}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} server did not start within 300 s")
            time.sleep(0.5)

    def __exit__(self, *exc_info) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._log.close()


async def stream_completion(http: httpx.AsyncClient, server: ServerProcess, body: dict, run_start: float
                            ) -> RequestResult:
    """POST a streamed /v1/completions and time it: first token, every token, the end."""
    body = {**body, "model": server.model, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    result = RequestResult(sent - run_start)
    async with http.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
        result.status = response.status_code
        result.retry_after = response.headers.get("retry-after")
        if response.status_code != 200:
            result.code = json.loads(await response.aread()).get("error", {}).get("code") or str(response.status_code)
            result.e2e_s = time.perf_counter() - sent
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                result.code = event["error"].get("code") or "error"
                continue
            if event.get("usage"):
                result.num_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    now = time.perf_counter() - sent
                    result.ttft_s = result.ttft_s if result.ttft_s is not None else now
                    result.token_times_s.append(now)
    result.e2e_s = time.perf_counter() - sent
    return result


async def wait_idle(server: ServerProcess, timeout_s: float = 600) -> None:
    """Until tinymlx's engine runs nothing (read from /metrics)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            text = (await http.get(f"{server.base_url}/metrics")).text
            values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                          if line.startswith(("tinymlx_running_sequences ", "tinymlx_waiting_sequences ")))
            if all(float(v) == 0 for v in values.values()) and len(values) == 2:
                return
            await asyncio.sleep(0.2)
    raise RuntimeError("the server did not go idle")


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, float | None]:
    return {f"p{q}": float(np.percentile(values, q)) if values else None for q in qs}
