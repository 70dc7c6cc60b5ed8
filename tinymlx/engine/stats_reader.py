"""StatsReader: the engine's stats() snapshot, read from the parts that own each figure."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from tinymlx.core.config import EngineConfig
from tinymlx.core.layer_specs import SharedKV, kv_source
from tinymlx.core.outputs import (
    CommCounts,
    EngineStats,
    ImageStats,
    KVGroupStats,
    PipelineStats,
    RequestMetrics,
    RequestStats,
)
from tinymlx.core.sequence import Sequence
from tinymlx.engine.step_counters import StepCounters
from tinymlx.kv.coordinator import KVCoordinator
from tinymlx.kv.disk.tier import DiskTier
from tinymlx.kv.group_blocks import NULL_BLOCK
from tinymlx.parallel.parallel_runner import ParallelRunner
from tinymlx.parallel.pipeline_runner import PipelineRunner
from tinymlx.runner.model_runner import ModelRunner
from tinymlx.sched.scheduler import Scheduler
from tinymlx.speculative.speculation import Speculation


class StatsReader:
    def __init__(self, config: EngineConfig, runner: ModelRunner, kv_coordinator: KVCoordinator, scheduler: Scheduler,
                 counters: StepCounters, speculation: Speculation | None, disk_tier: DiskTier | None,
                 weights_bytes: int, draft_weights_bytes: int = 0, num_omitted_images: Callable[[], int] = lambda: 0):
        self.config, self.runner, self.kv_coordinator, self.scheduler = config, runner, kv_coordinator, scheduler
        self._num_omitted_images = num_omitted_images
        self.counters, self.speculation, self.disk_tier = counters, speculation, disk_tier
        self.weights_bytes, self.draft_weights_bytes = weights_bytes, draft_weights_bytes
        chunk, longest = config.max_num_batched_tokens, config.max_model_len
        self.longest_context = tuple((n, int(min(longest, kv_coordinator.max_num_tokens(chunk, n))))
                                     for n in (1, 4, 16) if n <= config.max_num_seqs)

    def read(self, live: list[Sequence], metrics_of: Callable[[Sequence], RequestMetrics]) -> EngineStats:
        bm, now, spec, counters = self.kv_coordinator, time.monotonic(), self.speculation, self.counters
        requests = []
        for seq in live:
            # A live request's rate so far: its metrics as if it finished now.
            metrics = dataclasses.replace(metrics_of(seq), e2e_s=(seq.finish_time or now) - seq.arrival_time)
            requests.append(RequestStats(
                request_id=seq.request_id, status=seq.status.value, num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=metrics.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
                ttft_s=metrics.ttft_s, tokens_per_s=metrics.tokens_per_s,
                block_tables=tuple(tuple(page for page in table if page != NULL_BLOCK) for table in bm.page_tables(seq)),
            ))
        cache, specs = self.runner.kv_cache, self.runner.layer_specs
        page_nbytes = cache.page_nbytes
        groups = tuple(KVGroupStats(
            window=group.window, num_layers=len(layers), num_blocks=group.num_blocks,
            num_blocks_used=group.num_used_blocks, num_blocks_cached=group.num_cached_blocks,
            cached_pages=tuple(page for block_id in group.prefix_cache.evictable_block_ids
                               for page in group.pages[block_id]),
            nbytes=(group.num_used_blocks + group.num_cached_blocks) * group.cost * page_nbytes, cost=group.cost,
            num_shared_layers=sum(kv_source(specs, layer) in layers for layer, spec in enumerate(specs)
                                  if isinstance(spec, SharedKV)),
        ) for group, (_, layers) in zip(bm.groups, self.runner.kv_groups))
        parallel = self.runner if isinstance(self.runner, ParallelRunner) else None
        draft_runners = spec.runners if spec else ()
        return EngineStats(
            block_size=bm.block_size, num_pages_total=bm.num_pages, num_pages_used=bm.num_used_pages,
            num_pages_cached=bm.num_cached_pages, num_pages_free=bm.num_free_pages,
            num_pages_states=bm.num_state_pages, num_pages_releasable=bm.num_releasable_state_pages,
            kv_groups=groups, kv_cache_bytes=cache.nbytes,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_batched_tokens=counters.last_batch[0], num_batched_seqs=counters.last_batch[1],
            prefix_hit_rate=bm.prefix_hit_rate, num_preemptions=self.scheduler.num_preemptions,
            num_steps=counters.num_steps, num_generated_tokens=counters.num_generated_tokens,
            num_computed_prompt_tokens=counters.num_computed_prompt_tokens, requests=tuple(requests),
            tensor_parallel_size=self.config.tensor_parallel_size,
            comm_last_step=parallel.last_step_comm if parallel else CommCounts(),
            comm_total=parallel.ranks.collectives.counts if parallel else CommCounts(),
            pipeline=self._pipeline_stats(),
            speculative=self.config.speculative,
            num_draft_tokens=spec.num_draft_tokens if spec else 0,
            num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            num_verified_chunks=spec.num_verified_chunks if spec else 0,
            proposers=tuple(spec.counts.values()) if spec else (),
            step_cost=tuple(spec.target_cost.points().items()) if spec else (),
            draft_step_cost=tuple(spec.draft_cost.points().items()) if spec and spec.draft_cost else (),
            state_slots=bm.state_slot_stats(), weights_bytes=self.weights_bytes, images=self._image_stats(),
            kv_cache_bytes_used=bm.num_used_pages * page_nbytes, kv_cache_bytes_budget=bm.num_pages * page_nbytes,
            disk_cache=(self.disk_tier.stats(bm.num_lower_hits, bm.num_lower_misses, bm.num_lower_checkpoints)
                        if self.disk_tier else None),
            draft_weights_bytes=self.draft_weights_bytes, longest_context=self.longest_context,
            activation_bytes_budget=self.config.activation_bytes,
            draft_kv_cache_bytes=sum(runner.kv_cache.nbytes for runner in draft_runners),
            draft_kv_cache_bytes_budget=sum(runner.kv_cache.num_pages * runner.kv_cache.page_nbytes
                                            for runner in draft_runners),
        )

    def _pipeline_stats(self) -> PipelineStats | None:
        if not isinstance(self.runner, PipelineRunner):
            return None
        pipeline = self.runner.pipeline
        counters = pipeline.counters
        return PipelineStats(pipeline.stage_stats(self.weights_bytes, self.runner.pools_bytes_budget),
                             counters.bytes_last_step, counters.bubble_fraction, counters.num_micro_batches)

    def _image_stats(self) -> ImageStats | None:
        encoder = getattr(self.runner, "encoder_cache", None)
        omitted = self._num_omitted_images()
        if encoder is None:
            return ImageStats(0, 0, 0, 0, 0, omitted) if omitted else None
        return ImageStats(encoder.num_images, encoder.num_bytes, encoder.budget_bytes, encoder.num_encoded_images,
                          encoder.num_hits, omitted)

