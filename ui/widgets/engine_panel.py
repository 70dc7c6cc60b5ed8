"""EnginePanel: what the engine is doing, live: KV blocks and batch over time, rates, the block map.

Each graph prints its scale (the maximum it shows); the section titles say how much time they cover.
The block map zooms to the blocks in use or cached; `toggle_block_map_zoom` switches to the whole pool.

It redraws only what changed, and nothing while hidden: a relayout is a pass over the whole screen, and the
time it takes on the UI thread is time (and GIL) the engine's step loop loses.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from tinymlx.core.outputs import DiskCacheStats, PipelineStats
from tinymlx_ui.messages import EngineSnapshot
from tinymlx_ui.monitor import PanelData
from tinymlx_ui.widgets.block_map import BlockMap
from tinymlx_ui.widgets.graph_row import GraphRow, window_label
from tinymlx_ui.widgets.session_table import SessionTable
from tinymlx_ui.widgets.status_bar import format_bytes, kv_memory_text
from tinymlx_ui.widgets.text_update import set_text

_GRAPHS = [  # id, colour, which series
    ("used", "#4fc3f7", "pages_used"), ("cached", "#c8a040", "pages_cached"), ("free", "#8a8a8a", "pages_free"),
    ("running", "#aed581", "running"), ("tokens", "#4db6ac", "batch_tokens"), ("rate", "#ba68c8", "tokens_per_s"),
]


class EnginePanel(Vertical):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending: PanelData | None = None  # the newest data, not drawn while the panel is hidden
        self.num_shown = 0  # snapshots drawn

    def compose(self) -> ComposeResult:
        yield Static("KV blocks", id="blocks-title", classes="section", markup=False)
        for graph_id, color, _ in _GRAPHS[:3]:
            yield GraphRow(graph_id, color, id=graph_id)
        yield Static("Batch", id="batch-title", classes="section", markup=False)
        for graph_id, color, _ in _GRAPHS[3:]:
            yield GraphRow(graph_id, color, id=graph_id)
        yield Static(id="counters", markup=False)
        yield SessionTable()
        yield BlockMap()  # draws its own title (view, scale) and legend

    def toggle_block_map_zoom(self) -> bool:
        """Switch the block map between the blocks in use or cached and the whole pool; True: zoomed."""
        return self.query_one(BlockMap).toggle_zoom()

    def on_engine_snapshot(self, message: EngineSnapshot) -> None:
        self._pending = message.data
        if self.display:
            self.show(message.data)

    def on_show(self) -> None:
        if self._pending is not None:  # shown again: draw what came while hidden
            self.show(self._pending)

    def show(self, data: PanelData) -> None:
        self._pending = None
        self.num_shown += 1
        s = data.stats
        captions = {
            "used": f"used {s.num_pages_used}/{s.num_pages_total}", "cached": f"cached {s.num_pages_cached}",
            "free": f"free {s.num_pages_free}", "running": f"running {s.num_running} +{s.num_waiting}w",
            "tokens": f"tokens/step {s.num_batched_tokens}", "rate": f"tok/s {data.tokens_per_s:.1f}",
        }
        window = window_label(data.window_s)
        set_text(self.query_one("#blocks-title", Static), f"KV blocks · {window}")
        set_text(self.query_one("#batch-title", Static), f"Batch · {window}")
        for graph_id, _, series in _GRAPHS:
            self.query_one(f"#{graph_id}", GraphRow).show(getattr(data.series, series), captions[graph_id])
        counters = f"prefix hits {s.prefix_hit_rate:.0%}  preempted {s.num_preemptions}"
        if s.weights_bytes:
            counters += f"\nweights {format_bytes(s.weights_bytes)}"
        if s.kv_cache_bytes_budget:  # the status bar's words, the budget on a line of its own
            counters += "\n" + kv_memory_text(s.kv_cache_bytes_used, s.pools_bytes, s.pools_bytes_budget,
                                              before_budget="\n")
        if s.activation_bytes_budget:  # what the largest step may allocate beside the pools (chunks shrink to it)
            counters += f"\nactivations ≤ {format_bytes(s.activation_bytes_budget)}"
        if s.longest_context:  # what fits in the pool: one context alone, or each of several at once
            counters += "\nfits " + "  ".join(f"{tokens:,}" + (f" × {n}" if n > 1 else "") for n, tokens in s.longest_context)
        if s.disk_cache is not None:  # the prefix cache's disk tier: blocks memory missed, and its traffic
            counters += "\n" + _disk_counters(s.disk_cache)
        if len(s.kv_groups) > 1:  # the pages each kind of layer state uses (the block map's cells)
            counters += "\n" + "  ".join(f"{g.label} {g.num_blocks_used * g.cost}" for g in s.kv_groups)
        if s.state_slots is not None:  # a hybrid model's recurrent states: live ones, and checkpoints for prefix hits
            st = s.state_slots
            counters += (f"\nstate slots {st.num_live_used}/{st.num_live_slots}  "
                         f"checkpoints {st.num_checkpoints_cached}/{st.num_checkpoint_slots}"
                         f" in {s.num_pages_states} pages")
        if s.tensor_parallel_size > 1:  # bytes each rank puts into the collectives
            step, total = s.comm_last_step, s.comm_total
            sent = total.all_reduce_bytes + total.all_gather_bytes + total.broadcast_bytes
            counters += (f"\nTP {s.tensor_parallel_size}  all-reduce {step.num_all_reduces}/step "
                         f"{_megabytes(step.all_reduce_bytes)}\n      all-gather {_megabytes(step.all_gather_bytes)}"
                         f"  total {_megabytes(sent)}")
        if s.pipeline is not None:  # each stage: its layers, memory and busy share; the links' bytes; the idle share
            counters += "\n" + _pipeline_counters(s.pipeline)
        if s.speculative:
            counters += (f"\nspeculative {s.speculative.split(':')[0]}  accepted {s.acceptance_rate:.0%}  "
                         f"{s.mean_accepted_length:.2f} tok/verify")
            if len(s.proposers) > 1:
                counters += "\n  " + "  ".join(f"{p.name} {p.acceptance_rate:.0%} of {p.num_draft_tokens}"
                                               for p in s.proposers)
        set_text(self.query_one("#counters", Static), counters)
        self.query_one(SessionTable).rows = data.sessions
        self.query_one(BlockMap).data = data.block_map


def _disk_counters(disk: DiskCacheStats) -> str:
    if not disk.is_enabled:
        return "disk cache off"
    text = (f"disk cache {format_bytes(disk.num_bytes)} of {format_bytes(disk.capacity_bytes)}\n"
            f"disk hits {disk.hit_rate:.0%}  read {format_bytes(disk.num_bytes_read)}  "
            f"wrote {format_bytes(disk.num_bytes_written)}")
    problems = [f"{n} {what}" for n, what in ((disk.num_bad_files, "bad files deleted"),
                                              (disk.num_writes_dropped, "writes dropped"),
                                              (disk.num_write_errors, "write errors")) if n]
    return text + ("\ndisk: " + ", ".join(problems) if problems else "")


def _pipeline_counters(pipeline: PipelineStats) -> str:
    lines = [f"PP {len(pipeline.stages)}  bubble {pipeline.bubble_fraction:.0%}  {_megabytes(pipeline.bytes_last_step)}"
             f"/step  total {_megabytes(pipeline.bytes_total)}"]
    for stage in pipeline.stages:
        first, stop = stage.layers
        lines.append(f"  stage {stage.index} layers {first}-{stop - 1} on {stage.host}: weights "
                     f"{format_bytes(stage.weights_bytes)}, KV ≤ {format_bytes(stage.kv_cache_bytes_budget)}, "
                     f"busy {stage.busy_s_total:.1f} s")
    return "\n".join(lines)


def _megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.2f} MB" if num_bytes < 1e9 else f"{num_bytes / 1e9:.2f} GB"
