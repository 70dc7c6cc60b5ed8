"""What one pipeline stage runs of a model (plain data: parallel/stage_split.py chooses the layers, the
models keep only this part, the runner passes hidden states between stages)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineStage:
    """Stage `index` of `num_stages` runs decoder layers `layers`; the first also the embedding, the last also
    the final norm and the head (and the embedding again where the head is tied to it)."""

    index: int
    num_stages: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def holds_everything(self) -> bool:
        return self.num_stages == 1


def whole_model(num_layers: int) -> PipelineStage:
    """The one stage of a model without pipeline parallelism."""
    return PipelineStage(0, 1, range(num_layers))
