"""StatusBar: which model runs where, in which dtype, and the memory its weights, KV pool, disk cache and process take."""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

from textual.widgets import Static

from tinymlx.core.outputs import EngineStats
from tinymlx.turns.reply_format import PLAIN, ReplyFormat
from tinymlx_ui.widgets.text_update import set_text

MEMORY_POLL_S = 2.0  # the process's memory moves slowly; reading it is cheap but needs no more
_WIDTH = 120  # the snapshots' terminal, and a usual one


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    device: str
    dtype: str
    num_pages: int
    block_size: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    weights_bytes: int = 0  # every model's (a draft's too); this process's share under tensor parallelism
    kv_cache_bytes: int = 0  # the pools (KV, state slots, a draft's) allocated at load: EngineStats.pools_bytes
    kv_cache_bytes_budget: int = 0  # what they may grow to: EngineStats.pools_bytes_budget
    kv_groups: tuple[str, ...] = ()  # the labels of the KV groups sharing the pool
    has_chat_template: bool = True  # False: a base model, which continues the conversation's text
    # How replies read (the server's parser): thinking shown apart, harmony's markup kept for the parser
    reply_format: ReplyFormat = PLAIN


def format_bytes(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.2f} {unit}" if unit == "GiB" else f"{value:.0f} {unit}"
    return f"{num_bytes} B"


def kv_memory_text(used: int, allocated: int, budget: int, before_budget: str = " ") -> str:
    """The KV pool's three figures, worded the same wherever they are shown (status bar, engine panel):
    the blocks in use, the arrays as allocated now, and what they may grow to."""
    return (f"KV {format_bytes(used)} used, {format_bytes(allocated)} allocated,{before_budget}"
            f"{format_bytes(budget)} budget")


def process_memory() -> tuple[str, int]:
    """(label, bytes) for this process: the resident set on Linux (live), else the peak resident set."""
    try:
        with open("/proc/self/statm") as statm:
            return "process", int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB elsewhere
    return "process peak", peak if sys.platform == "darwin" else peak * 1024


def status_text(info: EngineInfo, memory: tuple[str, int] | None, stats: EngineStats | None = None,
                width: int = _WIDTH) -> str:
    """The line; `stats` (the latest engine stats) adds the KV bytes in use and the disk tier's size.
    What does not fit `width` goes, least needed first: the pool's shape, the disk cache, the weights,
    the process (the engine panel shows them all)."""
    shape = f"{info.num_pages} × {info.block_size} tokens"
    if len(info.kv_groups) > 1:  # the kinds of layer state share the pool
        shape += f" shared by {' + '.join(info.kv_groups)}"
    used, allocated, budget = ((stats.kv_cache_bytes_used, stats.pools_bytes, stats.pools_bytes_budget)
                               if stats is not None else (0, info.kv_cache_bytes, info.kv_cache_bytes_budget))
    disk = stats.disk_cache if stats is not None else None
    parts = [  # (text, which to drop first when too long: higher goes first; 0 stays)
        (info.model_name, 0), (f"{info.device} {info.dtype}", 0),
        ("base model: continues your text" if not info.has_chat_template else "", 0),
        (f"weights {format_bytes(info.weights_bytes)}" if info.weights_bytes else "", 2),
        (kv_memory_text(used, allocated, budget) if budget else f"KV pool {shape}", 0),
        (f"({shape})" if budget else "", 4),
        ("" if disk is None else f"disk cache {format_bytes(disk.num_bytes)} of {format_bytes(disk.capacity_bytes)}"
         if disk.is_enabled else "disk cache off", 3),
        (f"{memory[0]} {format_bytes(memory[1])}" if memory is not None else "", 1),
        (f"TP {info.tensor_parallel_size} ranks (memory of rank 0)" if info.tensor_parallel_size > 1 else "", 0),
        (f"PP {info.pipeline_parallel_size} stages (memory of the last)" if info.pipeline_parallel_size > 1 else "", 0),
    ]
    for dropping in (None, 4, 3, 2, 1):
        parts = [(text, rank) for text, rank in parts if text and rank != dropping]
        line = " " + " · ".join(text for text, _ in parts).replace(" · (", " (")  # the shape beside its KV figures
        if len(line) <= width:
            break
    return line


class StatusBar(Static):
    def __init__(self, info: EngineInfo, **kwargs) -> None:
        self.info = info
        self._memory, self._stats = process_memory(), None
        super().__init__(status_text(info, self._memory), markup=False, **kwargs)

    def on_mount(self) -> None:
        self.set_interval(MEMORY_POLL_S, self.refresh_memory)

    def on_resize(self) -> None:
        self._show()  # a wider terminal shows more of the line

    def refresh_memory(self) -> None:
        self._memory = process_memory()
        self._show()

    def show_stats(self, stats: EngineStats) -> None:
        """The engine's latest stats (the chat screen's poll): KV bytes in use, the disk cache."""
        self._stats = stats
        self._show()

    def _show(self) -> None:
        line = status_text(self.info, self._memory, self._stats, self.size.width or _WIDTH)
        set_text(self, line)  # new numbers: no relayout
