"""Chat UI overhead: `tinymlx chat` decoding two replies at once (engine panel open) vs AsyncEngine alone.

The chat runs headless (Textual's App.run_test, 120x40, the engine panel shown): two sessions, each sent
one message, stream their replies at the same time. The baseline sends the same two conversations
(system prompt + message, through the chat template) with the same SamplingParams (greedy, EOS
ignored, fixed max_tokens) as two concurrent AsyncEngine.generate streams, with no UI. Each run is a
fresh process (engine loaded from scratch, one warm-up request), and the variants alternate, so drift
in the machine's speed hits them alike; medians over the rounds are reported.

Both are timed where the caller receives the outputs (the UI's event loop in the chat): a stream's
decode tok/s is (tokens after the first output) / (time after the first output); aggregate (the bar's
measure) is the tokens both streams received while both were streaming, over that time: from the later
first output to the earlier last one (the chat sends its second message after the first reply started, so
that prefill falls inside the chat's first-to-last span but before the baseline's first output; the
first-to-last aggregate is reported too, as "span").
Also recorded: the engine's own decode rate per request, the CPU time of the event-loop thread (per
second of the run, and per token generated: the UI's cost, which the machine's load moves less than tok/s),
and context switches per second: the event loop's voluntary ones (its wakeups) and the other threads'
involuntary ones (the step loop and OpenBLAS's threads losing their core to someone else).
--baseline-ui REV adds the chat with the UI (ui/) of git revision REV and this checkout's engine.
--profile adds one chat run under cProfile (the event-loop thread only) and lists its top functions.
Headless Textual lays out and renders widgets but skips writing to a terminal: a real terminal adds that.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common
import numpy as np
from matplotlib import pyplot as plt

from tinymlx import SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.engine.async_engine import AsyncEngine
from tinymlx.engine.engine import Engine

WORKLOADS = {
    "full": {"max_tokens": 160, "rounds": 5},
    "quick": {"max_tokens": 24, "rounds": 1},
}
SYSTEM_PROMPT = "You are a helpful assistant."
PROMPTS = (
    "Write a Python function that merges overlapping intervals, with a docstring and a few tests.",
    "Explain step by step how a paged KV cache works in an LLM inference engine.",
)
SIZE = (120, 40)
BAR = 0.95  # the chat decodes at least this fraction as fast as AsyncEngine alone
TOP_N = 30
REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: a job file to run in this process
    parser.add_argument("--baseline-ui", metavar="REV", default=None,
                        help="also run the chat with the UI of git revision REV (this checkout's engine)")
    parser.add_argument("--profile", action="store_true", help="add one chat run under cProfile (event-loop thread)")
    args, _ = parser.parse_known_args()
    if args.worker:
        common.start_process_per_run(__doc__, WORKLOADS, _run_job)
        return
    setup = common.setup(__doc__, WORKLOADS, parser)
    workload = setup.workload
    base = {"model": args.model, "dtype": args.dtype, "max_tokens": workload["max_tokens"]}
    runs: dict[str, list[dict]] = {"engine": [], "chat": []}
    profile = None
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("engine", "engine", None), ("chat", "chat", None)]
        baseline_commit = None
        if args.baseline_ui:
            baseline_commit, packages = _baseline_ui(args.baseline_ui, Path(tmp))
            variants.append(("chat before", "chat", packages))
            runs["chat before"] = []
        try:
            for rnd in range(workload["rounds"]):
                for label, mode, packages in variants:
                    print(f"\n== round {rnd + 1}/{workload['rounds']}: {label}", file=sys.stderr)
                    runs[label].append(_run(label, {**base, "mode": mode}, Path(tmp) / f"{mode}-{rnd}-{len(runs[label])}"
                                            f"{'-before' if packages else ''}.json", packages))
            if args.profile:
                print("\n== chat under cProfile", file=sys.stderr)
                profile = _run("chat", {**base, "mode": "chat", "profile": True}, Path(tmp) / "profile.json", None)
        finally:
            if baseline_commit:
                subprocess.run(["git", "worktree", "remove", "--force", str(Path(tmp) / "baseline")], cwd=REPO,
                               check=False, capture_output=True)
    for label, rs in runs.items():  # greedy, the same two requests: every run should agree
        same = all(r["token_ids"] == runs["engine"][0]["token_ids"] for r in rs)
        print(f"{label}: tokens identical to the first engine run: {same}")
    summary = {label: _median(rs) for label, rs in runs.items()}
    table = _table(summary, workload)
    payload = {"workload": {**workload, "prompts": PROMPTS, "system_prompt": SYSTEM_PROMPT, "size": SIZE,
                            "params": "greedy, ignore_eos, max_tokens fixed"},
               "baseline_ui_commit": baseline_commit, "summary": summary, "table": table,
               "runs": {label: [_without_tokens(r) for r in rs] for label, rs in runs.items()}}
    if profile is not None:
        payload["profile"] = profile["profile"]
        for key, title in (("by_cumulative", "cumulative"), ("by_self", "self (tottime)")):
            rows = [[f["function"], f["calls"], f["self_s"], f["cumulative_s"]] for f in profile["profile"][key]]
            common.print_table(f"event-loop thread under cProfile, top {TOP_N} by {title} time",
                               ["function", "calls", "self s", "cumulative s"], rows)
    common.save_results("chat_overhead", args.quick, setup.info, payload, _plot(runs))


def _baseline_ui(rev: str, tmp: Path) -> tuple[str, str]:
    """A worktree of `rev` whose ui/ is importable as tinymlx_ui: (commit, the PYTHONPATH entry)."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    tree = tmp / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True,
                   capture_output=True)
    packages = tmp / "baseline-packages"
    packages.mkdir()
    (packages / "tinymlx_ui").symlink_to(tree / "ui")
    return commit, str(packages)


def _run(label: str, job: dict, path: Path, packages: str | None) -> dict:
    python_path = os.pathsep.join(filter(None, [packages, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path} if packages else None
    out = common.run_in_fresh_process(__file__, job, path, env=env)
    if job["mode"] == "chat" and (Path(out["tinymlx_ui"]).parent.parent == REPO) == bool(packages):
        raise RuntimeError(f"the {label} run imported tinymlx_ui from {out['tinymlx_ui']}")
    return out


# -- one run in one process -----------------------------------------------------------------------
def _run_job(job: dict) -> dict:
    params = common.fixed_length(job["max_tokens"])
    config = EngineConfig(model=job["model"], dtype=job["dtype"])
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p}] for p in PROMPTS]
    with tempfile.TemporaryDirectory() as data:
        os.environ["TINYMLX_DATA"] = data  # the chat's history goes to a throwaway store
        if job["mode"] == "engine":
            return asyncio.run(_engine_alone(config, conversations, params))
        return asyncio.run(_chat(config, params, job.get("profile", False)))


class StreamClock:
    """Times each stream's outputs where its caller receives them, by wrapping AsyncEngine.generate on
    the instance (the engine's and the UI's code are untouched)."""

    def __init__(self, engine: AsyncEngine):
        self.streams: list[dict] = []
        self._generate = engine.generate
        engine.generate = self._timed

    async def _timed(self, *args, **kwargs):
        record = {"times": [], "num_tokens": []}
        self.streams.append(record)
        async for output in self._generate(*args, **kwargs):
            record["times"].append(time.perf_counter())
            record["num_tokens"].append(len(output.token_ids))
            record["final"] = output
            yield output

    def result(self, cpu_s: float, window_s: float, switches: dict | None = None) -> dict:
        streams = []
        for s in self.streams:
            final = s.pop("final")
            t, n = s["times"], s["num_tokens"]
            streams.append({"decode_tok_s": (n[-1] - n[0]) / (t[-1] - t[0]),
                            "engine_decode_tok_s": final.metrics.tokens_per_s,
                            "num_tokens": n[-1], "num_outputs": len(t), "token_ids": final.token_ids,
                            "text": final.text, "first_s": t[0], "last_s": t[-1],
                            "timeline": [(ti - t[0], ni) for ti, ni in zip(t, n)]})
        start, end = min(s["first_s"] for s in streams), max(s["last_s"] for s in streams)
        decoded = sum(s["timeline"][-1][1] - s["timeline"][0][1] for s in streams)
        # While both stream: from the later first output to the earlier last one. The chat's second request
        # arrives after the first's first output (its session is opened, then sent), so its prefill lands
        # inside the first-to-last span; the baseline's two prefills both come before its first output.
        both_start, both_end = max(s["first_s"] for s in streams), min(s["last_s"] for s in streams)
        both = sum(_tokens_by(s, both_end) - _tokens_by(s, both_start) for s in streams)
        for s in streams:
            s["first_s"], s["last_s"] = s["first_s"] - start, s["last_s"] - start
        return {"streams": streams, "aggregate_decode_tok_s": both / (both_end - both_start),
                "span_decode_tok_s": decoded / (end - start),
                "loop_thread_cpu_s_per_s": cpu_s / window_s,
                # the UI's cost per token, which the machine's load moves less than tok/s does
                "loop_thread_cpu_ms_per_token": 1000 * cpu_s / sum(s["num_tokens"] for s in streams),
                "token_ids": [s.pop("token_ids") for s in streams],
                **({"context_switches_per_s": {k: v / window_s for k, v in switches.items()}} if switches else {})}


def _context_switches() -> dict[int, tuple[int, int]]:
    """{thread id: (voluntary, involuntary) context switches so far} of every thread of this process (Linux)."""
    counts = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            fields = dict(line.split(":\t") for line in (task / "status").read_text().splitlines() if ":\t" in line)
            counts[int(task.name)] = (int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"]))
        except (OSError, KeyError, ValueError):
            continue  # a thread that ended meanwhile
    return counts


def _switches_since(before: dict[int, tuple[int, int]]) -> dict[str, int]:
    """Context switches since `before`: the event loop's thread (its wakeups) and the others' (the step
    loop and OpenBLAS's threads: involuntary ones are the engine losing a core to someone else)."""
    after, loop = _context_switches(), threading.get_native_id()
    delta = {tid: (v - before.get(tid, (0, 0))[0], n - before.get(tid, (0, 0))[1]) for tid, (v, n) in after.items()}
    others = [d for tid, d in delta.items() if tid != loop]
    return {"loop_voluntary": delta.get(loop, (0, 0))[0], "loop_involuntary": delta.get(loop, (0, 0))[1],
            "engine_voluntary": sum(v for v, _ in others), "engine_involuntary": sum(n for _, n in others)}


def _tokens_by(stream: dict, t: float) -> float:
    """Tokens the caller had received by time `t` (perf_counter), interpolated between its outputs: the
    outputs of one step reach their streams microseconds apart, which must not count a step's token or not."""
    dt, n = zip(*stream["timeline"])
    return float(np.interp(t - stream["first_s"], dt, n))


async def _warm_up(engine: AsyncEngine) -> None:
    """One short request: the first forward of a process pays one-off costs."""
    async for _ in engine.generate("warm-up", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)):
        pass


async def _engine_alone(config: EngineConfig, conversations: list, params: SamplingParams) -> dict:
    engine = AsyncEngine(Engine.from_config(config, progress=False))
    try:
        await _warm_up(engine)
        clock = StreamClock(engine)

        async def consume(conversation):
            async for _ in engine.generate(conversation, params):
                pass

        switches, cpu0, t0 = _context_switches(), time.thread_time(), time.perf_counter()
        await asyncio.gather(*(consume(c) for c in conversations))
        return clock.result(time.thread_time() - cpu0, time.perf_counter() - t0, _switches_since(switches))
    finally:
        engine.shutdown()
        engine.engine.close()


async def _chat(config: EngineConfig, params: SamplingParams, profile: bool, panel: bool = True) -> dict:
    import tinymlx_ui
    from tinymlx_ui import ChatApp
    from tinymlx_ui.screens.chat import ChatScreen
    from tinymlx_ui.session import SessionSettings
    from tinymlx_ui.widgets.engine_panel import EnginePanel
    from tinymlx_ui.widgets.prompt_input import PromptInput

    @dataclasses.dataclass(frozen=True)
    class FixedLength(SessionSettings):
        """The sessions' settings, with EOS ignored: both variants generate exactly max_tokens."""

        def sampling_params(self) -> SamplingParams:
            return dataclasses.replace(super().sampling_params(), ignore_eos=True)

    defaults = FixedLength(SYSTEM_PROMPT, temperature=params.temperature, max_tokens=params.max_tokens)
    app = ChatApp(lambda: Engine.from_config(config, progress=False), defaults=defaults)
    async with app.run_test(size=SIZE) as pilot:
        while not isinstance(app.screen, ChatScreen):
            await pilot.pause(0.1)
        await pilot.pause(0.5)
        screen = app.screen
        if screen.query_one(EnginePanel).display != panel:
            screen.action_toggle_panel()
        await _warm_up(app.async_engine)
        clock = StreamClock(app.async_engine)
        profiler = cProfile.Profile() if profile else None
        switches, cpu0, t0 = _context_switches(), time.thread_time(), time.perf_counter()
        if profiler:
            profiler.enable()
        for index, prompt in enumerate(PROMPTS):  # as typed and sent: into the focused prompt, then Enter
            if index:
                await screen.action_new_session()
            text_area = screen.active_view.query_one(PromptInput)
            text_area.insert(prompt)
            text_area.action_submit()
        views = list(screen._views.values())
        # Await the replies' workers, not a poll: Pilot.pause posts a callback to every widget and forces a
        # screen update, and even a plain 10 Hz sleep wakes the event loop ten times a second, work (and
        # context switches) a user's chat never does.
        while len(screen._replies) < len(PROMPTS):  # each worker starts once its SendRequested is handled
            await asyncio.sleep(0.05)
        await asyncio.gather(*(worker.wait() for worker in list(screen._replies.values())))
        while any(v.is_replying for v in views):  # then the views take in ReplyFinished
            await asyncio.sleep(0.05)
        if profiler:
            profiler.disable()
        out = clock.result(time.thread_time() - cpu0, time.perf_counter() - t0, _switches_since(switches))
        shown = [v.session.turns[-1]["content"] for v in views]
        if shown != [s["text"] for s in out["streams"]]:
            raise RuntimeError("the replies saved differ from the engine's outputs")
    out["tinymlx_ui"] = tinymlx_ui.__file__
    if profiler:
        out["profile"] = _summarize_profile(profiler)
    assert threading.current_thread() is threading.main_thread()
    return out


# -- summary, table, plot -------------------------------------------------------------------------
def _median(runs: list[dict]) -> dict:
    num_streams = len(runs[0]["streams"])
    return {
        "num_runs": len(runs),
        "decode_tok_s_per_stream": [statistics.median(r["streams"][i]["decode_tok_s"] for r in runs)
                                    for i in range(num_streams)],
        "engine_decode_tok_s_per_stream": [statistics.median(r["streams"][i]["engine_decode_tok_s"] for r in runs)
                                           for i in range(num_streams)],
        "aggregate_decode_tok_s": statistics.median(r["aggregate_decode_tok_s"] for r in runs),
        "aggregate_decode_tok_s_runs": [r["aggregate_decode_tok_s"] for r in runs],
        "span_decode_tok_s": statistics.median(r["span_decode_tok_s"] for r in runs),
        "loop_thread_cpu_s_per_s": statistics.median(r["loop_thread_cpu_s_per_s"] for r in runs),
        "loop_thread_cpu_ms_per_token": statistics.median(r["loop_thread_cpu_ms_per_token"] for r in runs),
        "context_switches_per_s": {k: statistics.median(r["context_switches_per_s"][k] for r in runs)
                                   for k in runs[0].get("context_switches_per_s", {})},
        "num_outputs_per_stream": [statistics.median(r["streams"][i]["num_outputs"] for r in runs)
                                   for i in range(num_streams)],
    }


def _table(summary: dict, workload: dict) -> dict:
    engine, engine_span = summary["engine"]["aggregate_decode_tok_s"], summary["engine"]["span_decode_tok_s"]
    headers = ["variant", "runs", "stream 1 tok/s", "stream 2 tok/s", "aggregate tok/s", "x engine",
               f"bar {BAR}x", "span tok/s", "span x engine", "loop thread CPU", "CPU ms/token",
               "loop wakeups/s", "engine preempted/s"]
    rows = []
    for label, s in summary.items():
        ratio = s["aggregate_decode_tok_s"] / engine
        bar = "-" if label == "engine" else ("met" if ratio >= BAR else "MISSED")
        rows.append([label, s["num_runs"], *s["decode_tok_s_per_stream"], s["aggregate_decode_tok_s"], ratio, bar,
                     s["span_decode_tok_s"], s["span_decode_tok_s"] / engine_span,
                     f"{s['loop_thread_cpu_s_per_s']:.1%}", s["loop_thread_cpu_ms_per_token"],
                     s["context_switches_per_s"].get("loop_voluntary", "-"),
                     s["context_switches_per_s"].get("engine_involuntary", "-")])
    return common.print_table(f"decode tok/s, two streams of {workload['max_tokens']} tokens at once, medians "
                              f"(chat: {SIZE[0]}x{SIZE[1]}, engine panel open; aggregate: while both stream, "
                              f"span: first output to last)", headers, rows)


def _without_tokens(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("token_ids", "profile")}


def _summarize_profile(profiler: cProfile.Profile) -> dict:
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_, num_calls, self_s, cumulative_s, _) in stats.stats.items():
        where = name if filename == "~" else f"{_short(filename)}:{line}({name})"
        rows.append({"function": where, "calls": num_calls, "self_s": self_s, "cumulative_s": cumulative_s})
    return {"total_s": stats.total_tt, "by_cumulative": sorted(rows, key=lambda r: -r["cumulative_s"])[:TOP_N],
            "by_self": sorted(rows, key=lambda r: -r["self_s"])[:TOP_N]}


def _short(filename: str) -> str:
    parts = Path(filename).parts
    for root in ("textual", "rich", "markdown_it", "pygments", "tinymlx", "ui", "asyncio"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root) - 1:])
    return Path(filename).name


def _plot(runs: dict[str, list[dict]]) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = list(runs)
    width = 0.25
    for k, key in enumerate(("stream 1", "stream 2", "aggregate")):
        values = [[r["aggregate_decode_tok_s"] if key == "aggregate" else r["streams"][k]["decode_tok_s"]
                   for r in runs[label]] for label in labels]
        xs = np.arange(len(labels)) + (k - 1) * width
        left.bar(xs, [statistics.median(v) for v in values], width, label=key)
        for x, v in zip(xs, values):
            left.plot([x] * len(v), v, "k.", markersize=4)
    left.set_xticks(range(len(labels)), labels)
    left.set_ylabel("decode tok/s (median; dots: runs)")
    left.set_title("two streams at once")
    left.legend(fontsize=8)
    for label in labels:
        run = sorted(runs[label], key=lambda r: r["aggregate_decode_tok_s"])[len(runs[label]) // 2]
        for k, stream in enumerate(run["streams"]):
            t, n = zip(*stream["timeline"])
            right.plot(np.array(t) + stream["first_s"], n, label=f"{label}, stream {k + 1}",
                       linestyle="-" if k == 0 else "--")
    right.set_xlabel("s since the first output")
    right.set_ylabel("tokens received")
    right.set_title("tokens as the caller received them (median run)")
    right.legend(fontsize=7)
    return fig


if __name__ == "__main__":
    main()
