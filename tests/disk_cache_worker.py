"""A process of its own for test_disk_cache.py: `python disk_cache_worker.py SPEC` (SPEC: JSON).

spec: model (a saved tiny model's directory), disk_cache_dir, disk_cache_gb (optional), prompts (token id
lists, or chat messages: a vision model's with images as data URLs), max_tokens, start_at (optional: a time.time() to wait for, so two workers write at once), config
(optional: more EngineConfig fields).
It runs the prompts greedily, one after another, checking the engine after every step, waits for the
disk writes, and prints one JSON line: each prompt's output tokens, the engine's disk stats (and state
slots', for a hybrid model), the prompt tokens it computed, each request's cached tokens, the model's
fingerprint and the file keys of the first prompt's blocks.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from tiny_models import run_outputs

from tinymlx import SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.kv.prefix_cache import chain_hash

BLOCK_SIZE = 4


def main(spec: dict) -> dict:
    engine = Engine.from_config(EngineConfig(model=spec["model"], block_size=BLOCK_SIZE, num_pages=256,
                                             disk_cache_dir=spec["disk_cache_dir"],
                                             disk_cache_gb=spec.get("disk_cache_gb"), **spec.get("config", {})),
                                progress=False)
    if "start_at" in spec:
        time.sleep(max(0.0, spec["start_at"] - time.time()))
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    outputs = [run_outputs(engine, {0: [(prompt, params, "r")]})["r"] for prompt in spec["prompts"]]
    engine.disk_tier.flush()
    stats = engine.stats()
    engine.check()
    engine.close()
    return {"tokens": [out.token_ids for out in outputs], "disk": dataclasses.asdict(stats.disk_cache),
            "num_cached_tokens": [out.metrics.num_cached_tokens for out in outputs],
            "state_slots": dataclasses.asdict(stats.state_slots) if stats.state_slots else None,
            "num_computed_prompt_tokens": engine.num_computed_prompt_tokens,
            "fingerprint": engine.disk_tier.fingerprint,
            "keys": [engine.disk_tier.key(h) for h in block_hashes(spec["prompts"][0])]
            if all(isinstance(t, int) for t in spec["prompts"][0]) else []}


def block_hashes(prompt: list[int]) -> list[int]:
    """The chained hashes of a prompt's full blocks before its last token (what a hit can reuse)."""
    hashes, previous = [], None
    for index in range((len(prompt) - 1) // BLOCK_SIZE):
        previous = chain_hash(previous, prompt[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE])
        hashes.append(previous)
    return hashes


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
