"""PipelineRunner: rank 0's ModelRunner under pipeline parallelism, the last stage's. It wraps the runner's step:
the step's batch is cut into micro-batches, their host inputs go to every stage first, and rank 0's layers run on
each micro-batch as the stage before hands it over, while the stages before work on the next ones."""

from __future__ import annotations

import mlx.core as mx

from tinymlx.core.batch import ScheduledBatch
from tinymlx.core.config import EngineConfig
from tinymlx.models import CausalLM
from tinymlx.parallel.pipeline_group import PipelineGroup
from tinymlx.runner.model_runner import ModelRunner


class PipelineRunner(ModelRunner):
    def __init__(self, model: CausalLM, config: EngineConfig, pipeline: PipelineGroup):
        assert model.stage.is_last, "rank 0 runs the pipeline's last stage"
        super().__init__(model, config)
        self.pipeline = pipeline

    def run(self, batch: ScheduledBatch) -> mx.array:
        inputs = [self.prepare(part) for part in micro_batches(batch, self.pipeline.num_stages)]
        logits: list[mx.array] = []

        def last_stage(index: int, hidden: mx.array) -> None:
            logits.append(self.step_logits(inputs[index], hidden=hidden))
            mx.eval(logits[-1], self._pools)

        self.pipeline.run_step([part.to_arrays() for part in inputs], last_stage)
        return logits[0] if len(logits) == 1 else mx.concatenate(logits)


def micro_batches(batch: ScheduledBatch, most: int) -> list[ScheduledBatch]:
    """At most `most` parts of the batch, each whole chunks in the batch's order (their logits, concatenated, are
    the batch's), of about as many tokens each. Chunks of different sequences depend on nothing of each other's in
    a step, so the parts may run one after another; a chunk is never cut (a recurrent layer's state would have to
    pass between its pieces)."""
    num_parts = min(most, len(batch.chunks))
    if num_parts <= 1:
        return [batch]
    parts, part, tokens, target = [], [], 0, batch.num_batched_tokens / num_parts
    for index, chunk in enumerate(batch.chunks):
        part.append(chunk)
        tokens += chunk.num_tokens
        chunks_left, parts_left = len(batch.chunks) - index - 1, num_parts - len(parts) - 1
        if parts_left and (tokens >= target * (len(parts) + 1) or chunks_left == parts_left):
            parts.append(part)
            part = []
    parts.append(part)
    return [batch._replace(chunks=chunks, num_batched_tokens=sum(c.num_tokens for c in chunks)) for chunks in parts]
