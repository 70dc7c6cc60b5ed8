"""A pipeline stage's worker rank: `python -m tinymlx.parallel.stage_worker --rank R ...` (pipeline_group.py
starts it).

It runs what rank 0 sends over its control link, in order, until SHUTDOWN or until rank 0 is gone: load its
stage of the model (its shard, where the stage has tensor-parallel ranks: they join a ring of their own), run a
step's forward on the hidden states the stage before sends (the first stage: on the step's tokens) and send its
own on to the next stage. It never schedules or samples.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import numpy as np
from mlx.utils import tree_flatten

from tinymlx.core.config import EngineConfig
from tinymlx.core.pipeline_stage import PipelineStage
from tinymlx.models import activation_dtype, load_model
from tinymlx.parallel.collectives import Collectives
from tinymlx.parallel.launch import (
    READY_LINE,
    TensorParallelError,
    beat,
    exit_with_parent,
    join_ring,
    model_dir_here,
)
from tinymlx.parallel.pipeline_wire import (
    LinkKind,
    accept,
    connect,
    load_reply,
    receive_command,
    send_command,
)
from tinymlx.parallel.stage_link import StageLink, StageLinkError, StageListener
from tinymlx.parallel.step_broadcast import Command, unpack_text
from tinymlx.runner.model_runner import ModelRunner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinymlx.parallel.stage_worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--stage", type=int, required=True, help="this rank's stage, 0 first")
    parser.add_argument("--addresses", required=True, help="JSON: each rank's 'ip:port' for the links, rank 0 first")
    parser.add_argument("--next-rank", type=int, default=None,
                        help="the rank this one hands its hidden states to (none on the last stage)")
    parser.add_argument("--ring", default=None, help="JSON: the 'ip:port' of this stage's tensor-parallel ranks")
    parser.add_argument("--tp-rank", type=int, default=0, help="this rank's place in --ring")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process (rank 0) exits")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    addresses = json.loads(args.addresses)
    where = f"stage {args.stage} (rank {args.rank})"
    host, port = addresses[args.rank].rsplit(":", 1)
    listener = StageListener(host, int(port))
    print(READY_LINE, flush=True)
    beat()
    try:
        # The stage's tensor-parallel ranks join their own ring (rank 0's stage: with rank 0) before any link.
        collectives = Collectives(join_ring(args.tp_rank, json.loads(args.ring))) if args.ring else None
        kinds = {LinkKind.CONTROL: f"rank 0 -> {where}"}
        if args.stage > 0:
            kinds[LinkKind.HIDDEN] = f"stage {args.stage - 1} -> {where}"
        links = accept(listener, kinds)
        listener.close()
        hidden_out = None if args.next_rank is None else connect(
            addresses[args.next_rank], LinkKind.HIDDEN, f"{where} -> stage {args.stage + 1} (rank {args.next_rank})")
        return _serve(args.stage, collectives, links[LinkKind.CONTROL], links.get(LinkKind.HIDDEN), hidden_out)
    except (StageLinkError, TensorParallelError) as error:
        print(f"{where}: {error}; exiting", file=sys.stderr, flush=True)
        return 1


def _serve(stage: int, collectives: Collectives | None, control: StageLink, hidden_in: StageLink | None,
           hidden_out: StageLink | None) -> int:
    """Rank 0's commands, in order. A rank of the last stage (one of rank 0's tensor-parallel ranks) hands nothing
    on: it computes its share of the logits, which rank 0 gathers."""
    runner: ModelRunner | None = None
    while True:
        command, payload = receive_command(control)
        if command is Command.SHUTDOWN:
            return 0
        if command is Command.STEP:
            counts, arrays, start = payload[0], payload[1:], 0
            for count in counts:  # micro-batches, each handed on as soon as it is computed
                inputs = runner.inputs_from_arrays(arrays[start:start + count])
                start += count
                hidden, busy = hidden_in.receive() if hidden_in is not None else (None, np.zeros(0, np.float32))
                if hidden_out is None:
                    runner.execute(inputs, hidden)
                    continue
                began = time.perf_counter()
                hidden = runner.run_stage(inputs, hidden)
                hidden_out.send([hidden, np.append(np.array(busy), np.float32(time.perf_counter() - began))])
        elif command is Command.LOAD:
            runner = None
            runner, fingerprint, memory, error = _load(stage, collectives, json.loads(unpack_text(payload[0])))
            send_command(control, Command.LOAD, load_reply(fingerprint, memory, error))


def _load(stage: int, collectives: Collectives | None, message: dict
          ) -> tuple[ModelRunner | None, list[int] | None, tuple[int, int], str]:
    """This stage's runner (its shard, with `collectives`), its fingerprint (ModelRunner.fingerprint) and (weights
    bytes, pools bytes); or None and the error (printed here too)."""
    try:
        config = EngineConfig(**message["config"])
        start, stop = message["layers"]
        model = load_model(model_dir_here(message["model_dir"], config), config.dtype, shard=collectives,
                           stage=PipelineStage(stage, message["num_stages"], range(start, stop)))
        weights = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
        # The pool's pages are rank 0's; with this stage's weights they must fit this machine's working set too.
        runner = ModelRunner(model, config.resolve(model.args, activation_dtype(model), model.layer_specs(), weights,
                                                   held=model.stage.layers))
        return runner, runner.fingerprint(), (weights, runner.pools_bytes_budget), ""
    except Exception as error:  # noqa: BLE001 - reported to rank 0, which raises it
        traceback.print_exc()
        sys.stdout.flush()
        return None, None, (0, 0), f"{type(error).__name__}: {error}"


if __name__ == "__main__":
    sys.exit(main())
