"""A worker rank: `python -m tinymlx.parallel.worker --rank R --ring JSON` (started by launch.py).

It joins the ring, then runs what rank 0 broadcasts, in order, until SHUTDOWN: load a shard of the
model, run a step's forward, release the model. It never schedules or samples.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import mlx.core as mx

from tinymlx.core.config import EngineConfig
from tinymlx.models import activation_dtype, load_model
from tinymlx.parallel.collectives import Collectives, build_on_every_rank
from tinymlx.parallel.launch import READY_LINE, exit_with_parent, join_ring, model_dir_here
from tinymlx.parallel.step_broadcast import Command, unpack_arrays, unpack_text
from tinymlx.runner.model_runner import FINGERPRINT_FIELDS, ModelRunner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinymlx.parallel.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ring", required=True, help="JSON: the 'ip:port' addresses of every rank")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process (rank 0) exits")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    print(READY_LINE, flush=True)
    collectives = Collectives(join_ring(args.rank, json.loads(args.ring)))

    runner: ModelRunner | None = None
    while True:
        if not sys.stdin.buffer.readline():  # idle here, not in the ring (which polls): see RankProcess.wake
            print(f"rank {args.rank}: rank 0 closed its pipe; exiting", file=sys.stderr, flush=True)
            return 1
        try:
            command, payload = collectives.broadcast()
        except RuntimeError as error:
            print(f"rank {args.rank}: lost rank 0 ({error}); exiting", file=sys.stderr, flush=True)
            return 1
        if command is Command.SHUTDOWN:
            return 0
        if command is Command.STEP:
            runner.execute(runner.inputs_from_arrays(unpack_arrays(payload)))
        elif command is Command.LOAD:
            runner = None
            runner = _load(collectives, json.loads(unpack_text(payload)))
        elif command is Command.RELEASE:
            runner = None
            mx.clear_cache()
        elif command is Command.PROBE:
            collectives.time_all_reduce(*(int(v) for v in payload))


def _load(collectives: Collectives, message: dict) -> ModelRunner | None:
    config = EngineConfig(**message["config"])

    def build() -> ModelRunner:
        model = load_model(model_dir_here(message["model_dir"], config), config.dtype, shard=collectives)
        return ModelRunner(model, config.resolve(model.args, activation_dtype(model), model.layer_specs()))

    runner, error, agreed = build_on_every_rank(build, ModelRunner.fingerprint, len(FINGERPRINT_FIELDS),
                                                collectives.agree)
    if error is not None:
        traceback.print_exception(error)
        sys.stdout.flush()
    return runner if agreed else None


if __name__ == "__main__":
    sys.exit(main())
