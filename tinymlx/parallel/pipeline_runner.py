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
            # With tensor-parallel ranks beside this one, every collective runs, as theirs do (execute).
            logits.append(self.logits(inputs[index], eval_hidden=self.model.tensor_parallel_size > 1, hidden=hidden))

        self.pipeline.run_step([part.to_arrays() for part in inputs], last_stage)
        return logits[0] if len(logits) == 1 else mx.concatenate(logits)


def micro_batches(batch: ScheduledBatch, most: int) -> list[ScheduledBatch]:
    """At most `most` parts of the batch, in the batch's order (their logits, concatenated, are the batch's), of
    about as many tokens each. Chunks of different sequences depend on nothing of each other's in a step, so the
    parts may run one after another. With fewer chunks than parts, a long prefill chunk (an agent's prompt) is cut
    into pieces that follow each other through the stages: each stage runs a piece after the one before it, whose
    K/V it has written by then. A chunk that carries recurrent state, drafts or images is never cut (its state or
    its image's both-ways attention would have to pass between the pieces)."""
    chunks = list(batch.chunks)
    if len(chunks) < most:
        longest = max(range(len(chunks)), key=lambda i: chunks[i].num_tokens, default=None)
        chunk = chunks[longest] if longest is not None else None
        if chunk is not None and chunk.state is None and not chunk.num_draft_tokens and chunk.images is None:
            num_pieces = min(most - len(chunks) + 1, chunk.num_tokens)
            ends = [chunk.num_tokens * (i + 1) // num_pieces for i in range(num_pieces)]
            chunks[longest:longest + 1] = [chunk.piece(start, end) for start, end in zip([0, *ends], ends)]
    num_parts = min(most, len(chunks))
    if num_parts <= 1:
        return [batch]
    parts, part, tokens, target = [], [], 0, batch.num_batched_tokens / num_parts
    for index, chunk in enumerate(chunks):
        part.append(chunk)
        tokens += chunk.num_tokens
        chunks_left, parts_left = len(chunks) - index - 1, num_parts - len(parts) - 1
        if parts_left and (tokens >= target * (len(parts) + 1) or chunks_left == parts_left):
            parts.append(part)
            part = []
    parts.append(part)
    return [batch._replace(chunks=part, num_batched_tokens=sum(c.num_tokens for c in part)) for part in parts]
