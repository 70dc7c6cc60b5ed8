"""The stages of Engine.step and the one small interface a feature implements to attach at each.

    schedule   Planner.plan(batch) -> batch           speculation fills its draft slots
    run        ForwardHook.before/after_forward(batch)  the disk tier saves evicted blocks, fills restored ones
    sample     Masker.masks(chunks) -> TokenMasks      grammars allow only what may follow
    commit     Acceptor.accept(chunk, samples) -> kept  speculation keeps the agreeing drafts plus one
               Grammar.advance(seq_id, token) -> done   grammars consume each kept token
    after      Observer.observe(StepRecord)            metrics, the step-cost curve
               Forgetter.forget(seq_id)                per-sequence state dropped when a request ends
               IdleHook.idle()                         no request left: the pool gives memory back

A feature is registered with one `Stages.add(feature)`: it joins every stage whose method it has.
Removing a feature removes its module and that line; the step itself never names a feature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import mlx.core as mx

from tinymlx.core.batch import ScheduledBatch, ScheduledChunk, StepRecord
from tinymlx.sample.structured import TokenMasks


@runtime_checkable
class Planner(Protocol):
    def plan(self, batch: ScheduledBatch) -> ScheduledBatch: ...


@runtime_checkable
class ForwardHook(Protocol):
    def before_forward(self, batch: ScheduledBatch) -> None: ...
    def after_forward(self, batch: ScheduledBatch) -> None: ...


@runtime_checkable
class Masker(Protocol):
    def masks(self, chunks: list[ScheduledChunk]) -> TokenMasks | None: ...


@runtime_checkable
class Acceptor(Protocol):
    def accept(self, chunk: ScheduledChunk, samples: list[int]) -> list[int]: ...


@runtime_checkable
class Grammar(Protocol):
    def advance(self, seq_id: int, token: int) -> bool: ...


@runtime_checkable
class Observer(Protocol):
    def observe(self, step: StepRecord) -> None: ...


@runtime_checkable
class Forgetter(Protocol):
    def forget(self, seq_id: int) -> None: ...


@runtime_checkable
class IdleHook(Protocol):
    def idle(self) -> None: ...


class Stages:
    """The features attached to each stage, called in the order they were added."""

    def __init__(self) -> None:
        self._features: dict[type, list] = {kind: [] for kind in _KINDS}

    def add(self, feature: object) -> None:
        for kind, features in self._features.items():
            if isinstance(feature, kind):
                features.append(feature)

    @property
    def can_run_ahead(self) -> bool:
        """Whether a step may be scheduled and run before the last one's tokens are read (Engine.step): no
        planner drafts from them, no acceptor checks drafts against them, no forward hook reads the pool
        around a forward. Masks and grammars need them only for their own requests' rows."""
        return not any(self._features[kind] for kind in (Planner, Acceptor, ForwardHook))

    def plan(self, batch: ScheduledBatch) -> ScheduledBatch:
        for planner in self._features[Planner]:
            batch = planner.plan(batch)
        return batch

    def forward(self, batch: ScheduledBatch, run: Callable[[ScheduledBatch], mx.array]) -> mx.array:
        hooks = self._features[ForwardHook]
        for hook in hooks:
            hook.before_forward(batch)
        logits = run(batch)
        for hook in hooks:
            hook.after_forward(batch)
        return logits

    def masks(self, chunks: list[ScheduledChunk]) -> TokenMasks | None:
        masks = [m for m in (masker.masks(chunks) for masker in self._features[Masker]) if m is not None]
        assert len(masks) <= 1, "one feature masks the sampler's rows"
        return masks[0] if masks else None

    def accept(self, chunk: ScheduledChunk, samples: list[int]) -> list[int]:
        """The tokens a chunk keeps: without an acceptor a chunk has no drafts and one sample."""
        for acceptor in self._features[Acceptor]:
            samples = acceptor.accept(chunk, samples)
        return samples

    def advance(self, seq_id: int, token: int) -> bool:
        """True when a grammar is complete after `token`: the sequence stops."""
        return any([grammar.advance(seq_id, token) for grammar in self._features[Grammar]])

    def observe(self, step: StepRecord) -> None:
        for observer in self._features[Observer]:
            observer.observe(step)

    def forget(self, seq_id: int) -> None:
        for feature in self._features[Forgetter]:
            feature.forget(seq_id)

    def idle(self) -> None:
        for hook in self._features[IdleHook]:
            hook.idle()


_KINDS = (Planner, ForwardHook, Masker, Acceptor, Grammar, Observer, Forgetter, IdleHook)
