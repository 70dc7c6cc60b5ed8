"""Pipeline with tensor parallelism in a process of its own (rank 0 joins its stage's MLX ring, which MLX keeps
for the whole process), run by test_pipeline_parallel.py:

    python pipeline_scenarios.py MODEL_DIR ARRIVALS_JSON PIPELINE_SIZE TENSOR_SIZE [KILL_RANK]

ARRIVALS_JSON: {step: [[prompt, SamplingParams fields, request id], ...]}. Prints one JSON line: each request's
tokens and logprobs, and what stats() says of the run; with KILL_RANK, that rank is killed after three steps
and the line says what error the run ended with, and how soon."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tiny_models import ByteTokenizer, run_outputs

from tinymlx import Engine, EngineConfig, SamplingParams
from tinymlx.parallel import ParallelError


def main(model_dir: str, arrivals_json: str, pipeline_size: str, tensor_size: str, kill_rank: str = "") -> None:
    arrivals = {int(step): [(prompt, SamplingParams(**params), request_id) for prompt, params, request_id in items]
                for step, items in json.loads(Path(arrivals_json).read_text()).items()}
    config = EngineConfig(pipeline_parallel_size=int(pipeline_size), tensor_parallel_size=int(tensor_size),
                          block_size=4, num_pages=40, max_num_batched_tokens=24)
    engine = Engine.load(Path(model_dir), ByteTokenizer(), config, "tiny")
    if kill_rank:
        print(json.dumps(killed_mid_run(engine, arrivals, int(kill_rank))))
        return
    try:
        outputs = run_outputs(engine, arrivals)
        stats = engine.stats()
        local_heads = engine.runner.model.num_local_kv_heads
    finally:
        engine.close()
    print(json.dumps({
        "outputs": {rid: [out.token_ids, [entry.logprob for entry in out.logprobs]] for rid, out in outputs.items()},
        "num_preemptions": stats.num_preemptions, "prefix_hit_rate": stats.prefix_hit_rate,
        "stages": [stage.layers for stage in stats.pipeline.stages], "local_kv_heads": local_heads,
    }))


def killed_mid_run(engine: Engine, arrivals: dict, rank: int) -> dict:
    pid = engine.pipeline.pids[rank - 1]
    for prompt, params, request_id in arrivals[0]:
        engine.add_request(prompt, params, request_id=request_id)
    for _ in range(3):
        engine.step()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        while engine.has_unfinished_requests:
            engine.step()
    except ParallelError as error:
        seconds = time.monotonic() - killed
        engine.close()
        return {"error": str(error), "seconds_to_error": seconds, "worker_pids": engine.pipeline.pids}
    raise AssertionError("the run went on without its rank")


if __name__ == "__main__":
    main(*sys.argv[1:])
