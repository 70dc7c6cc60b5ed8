"""Tensor-parallel scenarios that need a process of their own (each starts its own ranks), run by
test_tensor_parallel.py: `python tp_scenarios.py NAME MODEL_DIR [HOSTFILE]`; prints one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from tinymlx import LLM, SamplingParams
from tinymlx.engine.async_engine import AsyncEngine, EngineDeadError
from tinymlx.parallel import RankGroup, TensorParallelError

LONG = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)


def start(model_dir: str, hostfile: str | None = None) -> LLM:
    return LLM(model_dir, block_size=4, num_pages=256, tensor_parallel_size=2, hostfile=hostfile, progress=False)


def kill_worker_mid_run(model_dir: str) -> dict:
    llm = start(model_dir)
    pids = RankGroup._current.pids
    stream = llm.stream("a long reply", LONG)
    for _ in range(3):
        next(stream)
    os.kill(pids[0], signal.SIGKILL)
    killed = time.monotonic()
    try:
        for _ in stream:
            pass
    except TensorParallelError as error:
        return {"error": str(error), "seconds_to_error": time.monotonic() - killed, "worker_pids": pids}
    raise AssertionError("the run went on without its worker")


def kill_worker_idle(model_dir: str) -> dict:
    """No request in flight: the async engine's idle loop notices, and the next caller hears why."""
    async_engine = AsyncEngine(start(model_dir).engine)
    pids = RankGroup._current.pids
    os.kill(pids[0], signal.SIGKILL)
    killed = time.monotonic()
    while async_engine.is_alive and time.monotonic() - killed < 10:
        time.sleep(0.01)
    seconds = time.monotonic() - killed

    async def ask() -> str:
        try:
            async for _ in async_engine.generate("hello", LONG):
                pass
        except EngineDeadError as error:
            return str(error)
        raise AssertionError("a dead engine took a request")

    return {"error": asyncio.run(ask()), "seconds_to_error": seconds, "worker_pids": pids}


def serve_until_killed(model_dir: str) -> None:
    start(model_dir)
    print(json.dumps({"worker_pids": RankGroup._current.pids}), flush=True)
    threading.Event().wait(120)  # the test kills this process


def start_failure(model_dir: str, hostfile: str) -> dict:
    began = time.monotonic()
    try:
        start(model_dir, hostfile)
    except TensorParallelError as error:
        return {"error": str(error), "seconds_to_error": time.monotonic() - began}
    raise AssertionError("the ranks started")


def generate(model_dir: str, hostfile: str) -> dict:
    llm = start(model_dir, hostfile)
    output = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    worker_environ = Path(f"/proc/{RankGroup._current.pids[0]}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in worker_environ if b"=" in item)
    return {"token_ids": output.token_ids, "worker_env": env.get("TINYMLX_TEST_ENV"),
            "num_all_reduces": llm.stats().comm_total.num_all_reduces}


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    result = {"kill-worker-mid-run": kill_worker_mid_run, "kill-worker-idle": kill_worker_idle,
              "serve-until-killed": serve_until_killed, "start": start_failure, "generate": generate}[name](*args)
    print(json.dumps(result), flush=True)
