"""ParallelRunner: rank 0's ModelRunner under tensor parallelism. It wraps the runner's step: the step's
host inputs go to the worker ranks first, which run the same forward on their shards (worker.py)."""

from __future__ import annotations

import mlx.core as mx

from tinymlx.core.batch import ScheduledBatch
from tinymlx.core.config import EngineConfig
from tinymlx.core.outputs import CommCounts
from tinymlx.models import CausalLM
from tinymlx.parallel.rank_group import RankGroup
from tinymlx.runner.model_runner import ModelRunner


class ParallelRunner(ModelRunner):
    def __init__(self, model: CausalLM, config: EngineConfig, ranks: RankGroup):
        super().__init__(model, config)
        self.ranks = ranks
        self.last_step_comm = CommCounts()  # what the last step put through the collectives

    def run(self, batch: ScheduledBatch) -> mx.array:
        inputs, before = self.with_image_features(self.prepare(batch)), self.ranks.collectives.counts
        # Every rank evaluates the whole hidden state, so every rank runs the same collectives even
        # when no token samples.
        logits = self.ranks.run_step(self, inputs.to_arrays(), lambda: self.logits(inputs, eval_hidden=True))
        self.last_step_comm = self.ranks.collectives.counts - before
        return logits
