"""What the engine hands back: per-request outputs with metrics, and engine-wide stats."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(frozen=True)
class ProposerStats:
    """Speculative decoding's counts for one proposer (in EngineStats.proposers)."""

    name: str  # "ngram" | "draft"
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verified_chunks: int

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(frozen=True)
class CommCounts:
    """Collective calls and the bytes each rank puts into them."""

    num_all_reduces: int = 0  # the model's: two per layer
    all_reduce_bytes: int = 0
    num_all_gathers: int = 0  # the logits' vocabulary slices: one per step that samples
    all_gather_bytes: int = 0
    num_broadcasts: int = 0  # rank 0's commands to the workers (two per step) and load-time checks
    broadcast_bytes: int = 0

    def __sub__(self, other: CommCounts) -> CommCounts:
        return CommCounts(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    queue_s: float | None  # arrival -> first scheduled (time spent in the waiting queue)
    ttft_s: float | None  # arrival -> first token
    e2e_s: float | None  # arrival -> finish
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens reused from the prefix cache
    num_output_tokens: int
    num_preemptions: int
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request
    num_accepted_tokens: int = 0  # of those, the ones it kept

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate after the first token."""
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2 or self.e2e_s <= self.ttft_s:
            return None
        return (self.num_output_tokens - 1) / (self.e2e_s - self.ttft_s)


@dataclass(frozen=True)
class RequestOutput:
    """Cumulative state of one request, plus what is new since its previous output."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] | None
    metrics: RequestMetrics
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason "stop"), if one did


@dataclass(frozen=True)
class RequestStats:
    request_id: str
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    ttft_s: float | None
    tokens_per_s: float | None
    block_tables: tuple[tuple[int, ...], ...]  # the pages it holds, by page group


@dataclass(frozen=True)
class KVGroupStats:
    """One KV group: layers of one kind of state, with their own blocks, each `cost` pages of the shared pool."""

    window: int | None  # a sliding window's tokens; None: full attention
    num_layers: int
    num_blocks: int  # its ids: the most blocks it could hold with the pool to itself
    num_blocks_used: int
    num_blocks_cached: int
    cached_pages: tuple[int, ...]  # the cached blocks' pages, least recently used first
    nbytes: int  # K and V of its blocks used and cached
    cost: int = 1  # pages one of its blocks takes
    num_shared_layers: int = 0  # shared-KV layers that read this group's blocks and hold none of their own

    @property
    def label(self) -> str:
        return "full" if self.window is None else f"window {self.window}"


@dataclass(frozen=True)
class StateSlotStats:
    """The recurrent layers' state slots (hybrid models): live ones and checkpoints for prefix hits."""

    num_layers: int
    num_live_slots: int  # one per sequence that may run at once
    num_live_used: int
    num_checkpoint_slots: int
    num_checkpoints_cached: int
    num_resumed: int  # admissions that resumed from a checkpoint
    num_resumed_tokens: int  # the tokens those did not recompute
    nbytes: int  # every slot held now (the zero slot and the checkpoints' included), every recurrent layer
    slot_nbytes: int = 0  # one slot, every recurrent layer
    num_fixed_slots: int = 0  # slots outside the KV pool (zero, live, snapshots): the checkpoints are its pages


@dataclass(frozen=True)
class DiskCacheStats:
    """The prefix cache's disk tier (disk_tier.py). Hits and misses count full prompt blocks that memory
    did not hold: restored from disk, or computed."""

    directory: str
    is_enabled: bool  # False: turned off for now (the chat's F2), reading and writing nothing
    capacity_bytes: int
    num_bytes: int  # the block files this process knows of (a rescan adds other processes')
    num_files: int
    num_hits: int
    num_misses: int
    num_bytes_read: int
    num_bytes_written: int
    num_files_written: int
    num_writes_dropped: int  # the writer's queue was full: those blocks were not saved
    num_bad_files: int  # truncated, corrupted or foreign files found, deleted and recomputed
    num_write_errors: int  # a full or read-only disk
    num_checkpoint_hits: int = 0  # hybrid models: recurrent-state checkpoints restored from disk (a hit's resume point)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / (self.num_hits + self.num_misses) if self.num_hits + self.num_misses else 0.0


@dataclass(frozen=True)
class ImageStats:
    """The vision encoder's cache (vision/encoder_cache.py) and what the engine did with images."""

    num_cached_images: int  # images whose features the cache holds
    cache_bytes: int
    cache_bytes_budget: int
    num_encoded_images: int  # runs of the vision tower, image by image
    num_cache_hits: int  # images a step found already encoded
    num_omitted_images: int = 0  # images a text-only model was given, replaced by a note


@dataclass(frozen=True)
class StageStats:
    """One pipeline stage: where it runs, what it holds, how long it computed."""

    index: int  # 0 first; the last is rank 0's
    layers: tuple[int, int]  # its decoder layers, [start, stop)
    host: str  # the hostfile's ssh name (this machine's for rank 0)
    weights_bytes: int  # its parameters
    kv_cache_bytes_budget: int  # every page of its pool (its layers' share of each page), its state slots
    busy_s: float  # computing, in the last step
    busy_s_total: float
    sent_bytes_total: int  # over its links: the last stage's (rank 0's) the steps' inputs, the others' hidden states


@dataclass(frozen=True)
class PipelineStats:
    """Pipeline parallelism (parallel/pipeline_group.py): the stages, the links' traffic, the bubble."""

    stages: tuple[StageStats, ...]
    bytes_last_step: int  # sent over every link in the last step: the step's inputs and each hand-off
    # Of the stages' time over the steps so far, the share spent waiting (1 - busy / (stages x wall)): with one
    # micro-batch a stage waits for the others' (num_stages - 1) / num_stages of each step.
    bubble_fraction: float
    num_micro_batches: int  # the last step's

    @property
    def bytes_total(self) -> int:
        return sum(stage.sent_bytes_total for stage in self.stages)


@dataclass(frozen=True)
class EngineStats:
    block_size: int
    num_pages_total: int  # the pool's pages, shared by the KV groups; these counts are in pages (KVGroupStats.cost)
    num_pages_used: int  # referenced by a live sequence
    num_pages_cached: int  # unreferenced but holding a reusable prefix
    num_pages_free: int  # held by no block and no checkpoint
    kv_groups: tuple[KVGroupStats, ...]  # the pool per KV group, in layer order of first appearance
    kv_cache_bytes: int  # the whole pool as allocated now: every group's K and V
    num_running: int
    num_waiting: int
    num_batched_tokens: int  # in the last step
    num_batched_seqs: int  # in the last step
    prefix_hit_rate: float  # prompt tokens served from the cache / prompt tokens admitted
    num_preemptions: int
    num_steps: int
    num_generated_tokens: int
    num_computed_prompt_tokens: int  # prefill tokens actually run through the model
    requests: tuple[RequestStats, ...]  # live requests, oldest first
    tensor_parallel_size: int = 1
    comm_last_step: CommCounts = CommCounts()  # tensor-parallel collectives (all zero without TP)
    comm_total: CommCounts = CommCounts()
    pipeline: PipelineStats | None = None  # with pipeline parallelism
    speculative: str | None = None  # the proposer, or None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verified_chunks: int = 0  # decode steps that verified drafts
    proposers: tuple[ProposerStats, ...] = ()  # the same counts per proposer ("ngram", "draft")
    step_cost: tuple[tuple[int, float], ...] = ()  # the learned step-cost curve: (rows, expected seconds)
    draft_step_cost: tuple[tuple[int, float], ...] = ()  # the draft model's forwards', likewise
    state_slots: StateSlotStats | None = None  # hybrid models' recurrent states
    weights_bytes: int = 0  # the model's parameters (this rank's shard under tensor parallelism)
    kv_cache_bytes_used: int = 0  # the blocks referenced by live sequences, in every group's layers
    kv_cache_bytes_budget: int = 0  # every page of the pool: what its arrays may grow to
    disk_cache: DiskCacheStats | None = None  # the prefix cache's disk tier, when there is one
    images: ImageStats | None = None  # a vision-language model's encoder cache and image counts
    draft_weights_bytes: int = 0  # a draft model's or MTP head's own parameters (the head shares the embedding)
    draft_kv_cache_bytes: int = 0  # its pool as allocated now: as many pages as the target's, one table for both
    draft_kv_cache_bytes_budget: int = 0  # every page of it
    # What fits: (sequences at once, the longest context each may reach) for 1, 4 and 16 at once (up to
    # max_num_seqs), within the pool's pages and max_model_len.
    longest_context: tuple[tuple[int, int], ...] = ()
    # The largest step's activations the scheduler keeps every step within (core/step_memory.py's estimate).
    activation_bytes_budget: int = 0
    # A hybrid's recurrent checkpoints are pages of the pool, in a region at its top (kv/block_pool.py):
    # used + cached + free + states = total. Of the region's pages, those a sequence short of pages may take
    # back (its last slots, empty or holding an evictable checkpoint).
    num_pages_states: int = 0
    num_pages_releasable: int = 0

    @property
    def num_pages_available(self) -> int:
        """Pages a new sequence may take now: free ones, cached blocks' (evicted), the region's releasable."""
        return self.num_pages_free + self.num_pages_cached + self.num_pages_releasable

    @property
    def what_fits(self) -> str:
        """`longest_context` in words: "32,768 tokens alone, 8,192 each beside 3 others, ..."."""
        return ", ".join(f"{tokens:,} tokens alone" if n == 1 else f"{tokens:,} each beside {n - 1} others"
                         for n, tokens in self.longest_context)

    @property
    def pools_bytes(self) -> int:
        """The engine's pools as allocated now: the KV pool, the recurrent state slots, the draft's pool."""
        return self.kv_cache_bytes + self._state_bytes + self.draft_kv_cache_bytes

    @property
    def pools_bytes_budget(self) -> int:
        """What those pools may grow to, all within the `kv_cache_bytes` asked for (EngineConfig): the KV pool
        (the recurrent checkpoints are its pages), the fixed state slots, the draft's pool."""
        fixed = self.state_slots.num_fixed_slots * self.state_slots.slot_nbytes if self.state_slots is not None else 0
        return self.kv_cache_bytes_budget + fixed + self.draft_kv_cache_bytes_budget

    @property
    def memory_budget_bytes(self) -> int:
        """Everything the engine may allocate beyond the weights: the pools' budget and the activations'."""
        return self.pools_bytes_budget + self.activation_bytes_budget

    @property
    def memory_bytes(self) -> int:
        """What the engine holds now: every model's weights, every pool as allocated, the image cache."""
        images = self.images.cache_bytes if self.images is not None else 0
        return self.weights_bytes + self.draft_weights_bytes + self.pools_bytes + images

    @property
    def _state_bytes(self) -> int:
        return self.state_slots.nbytes if self.state_slots is not None else 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step yields per sequence: its accepted drafts plus one."""
        return 1 + self.num_accepted_tokens / self.num_verified_chunks if self.num_verified_chunks else 0.0
