"""Prometheus metrics for `/metrics`, each server with its own registry.

Per request (observed when it ends): outcome, queue wait, time to first token, inter-token latency.
Per engine step (from AsyncEngine's on_step hook): sequences and tokens in the batch. At scrape time,
from the latest engine stats: KV blocks, prefix hit rate, preemptions, running and waiting, the memory
of the weights and the KV pool, and the disk tier's lookups, traffic and size.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tinymlx.core.outputs import DiskCacheStats, EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        """`stats`: returns the engine's latest EngineStats (read at every scrape)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tinymlx_requests", "Finished HTTP requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.rejections = Counter("tinymlx_rejections", "Requests refused by admission control", ["reason"], registry=r)
        self.queue_depth = Gauge("tinymlx_queue_depth", "Admitted choices still waiting for their first token",
                                 registry=r)
        self.queue_wait = Histogram("tinymlx_queue_wait_seconds", "Arrival to first scheduled step",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tinymlx_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("tinymlx_inter_token_latency_seconds", "Time between a choice's tokens",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("tinymlx_batch_sequences", "Sequences in an engine step", buckets=_SIZE_BUCKETS,
                                    registry=r)
        self.batch_tokens = Histogram("tinymlx_batch_tokens", "Tokens in an engine step", buckets=_SIZE_BUCKETS,
                                      registry=r)
        self.images_omitted = Counter("tinymlx_images_omitted", "Images a text-only model got as a one-line note "
                                      "(--images note)", registry=r)
        r.register(_EngineCollector(stats))

    def observe_step(self, stats: EngineStats) -> None:
        if stats.num_batched_seqs:
            self.batch_size.observe(stats.num_batched_seqs)
            self.batch_tokens.observe(stats.num_batched_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine state read from the stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self):
        s: EngineStats = self._stats()
        blocks = GaugeMetricFamily("tinymlx_kv_pages", "KV cache pages by state", labels=["state"])
        for state, value in (("used", s.num_pages_used), ("cached", s.num_pages_cached), ("free", s.num_pages_free),
                             ("states", s.num_pages_states)):
            blocks.add_metric([state], value)
        yield blocks
        yield GaugeMetricFamily("tinymlx_prefix_hit_rate", "Prompt tokens served from the prefix cache, as a share",
                                value=s.prefix_hit_rate)
        yield CounterMetricFamily("tinymlx_preemptions", "Sequences preempted (recomputed later)",
                                  value=s.num_preemptions)
        yield GaugeMetricFamily("tinymlx_running_sequences", "Sequences in the running batch", value=s.num_running)
        yield GaugeMetricFamily("tinymlx_waiting_sequences", "Sequences in the engine's waiting queue",
                                value=s.num_waiting)
        yield CounterMetricFamily("tinymlx_generated_tokens", "Tokens generated", value=s.num_generated_tokens)
        drafted = CounterMetricFamily("tinymlx_draft_tokens", "Speculative decoding: draft tokens verified, by "
                                      "proposer", labels=["proposer"])
        kept = CounterMetricFamily("tinymlx_accepted_draft_tokens", "Speculative decoding: drafts kept, by proposer",
                                   labels=["proposer"])
        for proposer in s.proposers:
            drafted.add_metric([proposer.name], proposer.num_draft_tokens)
            kept.add_metric([proposer.name], proposer.num_accepted_tokens)
        yield drafted
        yield kept
        memory = GaugeMetricFamily("tinymlx_memory_bytes", "Bytes of the weights, the KV pool as allocated, the KV "
                                   "blocks in use, the KV pool's budget, a draft's weights and pool, every pool "
                                   "with its budget, and all the engine holds", labels=["kind"])
        for kind, value in (("weights", s.weights_bytes), ("kv_cache", s.kv_cache_bytes),
                            ("kv_cache_used", s.kv_cache_bytes_used), ("kv_cache_budget", s.kv_cache_bytes_budget),
                            ("draft_weights", s.draft_weights_bytes), ("draft_kv_cache", s.draft_kv_cache_bytes),
                            ("pools", s.pools_bytes), ("pools_budget", s.pools_bytes_budget), ("total", s.memory_bytes)):
            memory.add_metric([kind], value)
        yield memory
        if s.disk_cache is not None:
            yield from _disk_cache_metrics(s.disk_cache)


def _disk_cache_metrics(disk: DiskCacheStats):
    """The prefix cache's disk tier: lookups of blocks memory missed, traffic, and what it holds."""
    lookups = CounterMetricFamily("tinymlx_disk_cache_lookups", "Prompt blocks memory missed, by whether the disk "
                                  "tier served them", labels=["result"])
    lookups.add_metric(["hit"], disk.num_hits)
    lookups.add_metric(["miss"], disk.num_misses)
    yield lookups
    yield CounterMetricFamily("tinymlx_disk_cache_read_bytes", "Bytes read from the disk tier",
                              value=disk.num_bytes_read)
    yield CounterMetricFamily("tinymlx_disk_cache_written_bytes", "Bytes written to the disk tier",
                              value=disk.num_bytes_written)
    yield CounterMetricFamily("tinymlx_disk_cache_dropped_writes", "Blocks not saved: the writer's queue was full",
                              value=disk.num_writes_dropped)
    yield CounterMetricFamily("tinymlx_disk_cache_bad_files", "Truncated, corrupted or foreign block files deleted",
                              value=disk.num_bad_files)
    yield GaugeMetricFamily("tinymlx_disk_cache_bytes", "Bytes of block files in the disk tier", value=disk.num_bytes)
    yield GaugeMetricFamily("tinymlx_disk_cache_capacity_bytes", "The disk tier's bound",
                            value=disk.capacity_bytes)
