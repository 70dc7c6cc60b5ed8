"""Engine overhead: the share of Engine.step spent outside the model forward, at concurrency 32.

A burst of 32 requests (prompts of U[32, 256] tokens, fixed output length, EOS ignored) keeps the
engine saturated. Pass 1 times every step and the stages it calls by wrapping them on the engine's
instances (the engine's code is untouched): Scheduler.schedule, ModelRunner.run (the forward, split
into host-side input prep + graph building and the mx.eval that computes it), the sampler and
Scheduler.commit; what remains of the step is detokenization, outputs and bookkeeping. Pass 2 runs
the same burst on a fresh engine under cProfile and summarises the top functions.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import time
from pathlib import Path

import common
import mlx.core as mx
import numpy as np
from matplotlib import pyplot as plt

from tinymlx import Engine
from tinymlx.runner import model_runner

WORKLOADS = {
    "full": {"num_requests": 32, "prompt_len": (32, 256), "output_len": 128},
    "quick": {"num_requests": 32, "prompt_len": (16, 32), "output_len": 8},
}
STAGES = ("schedule", "forward: inputs + graph", "forward: mx.eval", "sample", "commit", "other")
TOP_N = 25
PROFILE_NOTE = (
    "cProfile does not see MLX's native functions (nanobind): mx.eval's compute shows up as the self time "
    "of its Python caller, so ModelRunner.run's self time is mostly the forward itself."
)


class StepTimer:
    """Per-step stage times, collected by wrapping an engine's stages on its instances."""

    def __init__(self, engine: Engine):
        self.steps: list[dict] = []
        self._current: dict[str, float] = {}
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "run", "forward")
        self._wrap(engine, "sampler", "sample")
        self._wrap(engine.scheduler, "commit", "commit")
        self._wrap(engine, "step", "step")

    def _wrap(self, owner, attr: str, stage: str) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            if stage == "step":
                self._current = {"eval": 0.0}
            start = time.perf_counter()
            result = original(*args, **kwargs)
            self._current[stage] = self._current.get(stage, 0.0) + time.perf_counter() - start
            if stage == "schedule":
                self._current["num_tokens"] = result.num_batched_tokens
                self._current["is_decode_only"] = all(len(c.token_ids) == 1 for c in result.chunks)
            elif stage == "step" and self._current.get("num_tokens"):  # empty steps ran no model
                self.steps.append(self._record(self._current))
            return result

        setattr(owner, attr, timed)

    @contextlib.contextmanager
    def timing_eval(self):
        """Time the runner's mx.eval: model_runner's `mx` is swapped for a proxy while the block runs."""
        timer = self

        class TimedMx:
            def __getattr__(self, name):
                return getattr(mx, name)

            @staticmethod
            def eval(*args):
                start = time.perf_counter()
                mx.eval(*args)
                timer._current["eval"] += time.perf_counter() - start

        model_runner.mx = TimedMx()
        try:
            yield
        finally:
            model_runner.mx = mx

    @staticmethod
    def _record(t: dict) -> dict:
        times = {
            "schedule": t["schedule"], "forward: inputs + graph": t["forward"] - t["eval"],
            "forward: mx.eval": t["eval"], "sample": t.get("sample", 0.0), "commit": t.get("commit", 0.0),
        }
        times["other"] = t["step"] - sum(times.values())
        return {"step_s": t["step"], "num_tokens": t["num_tokens"], "is_decode_only": t["is_decode_only"],
                "stages_s": times}


def main() -> None:
    args, info, workload, loaded = common.start(__doc__, WORKLOADS)
    rng = np.random.default_rng(args.seed)
    n = workload["num_requests"]
    prompts = common.sample_prompts(common.text_token_ids(loaded.tokenizer), n, workload["prompt_len"], rng)
    params = [common.fixed_length(workload["output_len"])] * n
    common.warm_up(loaded)

    engine = common.new_engine(loaded)
    timer = StepTimer(engine)
    with timer.timing_eval():
        run = common.run_tinymlx(engine, prompts, params, desc="timed pass")
    del engine
    kinds = (("all steps", lambda s: True), ("decode-only steps", lambda s: s["is_decode_only"]),
             ("steps with prefill", lambda s: not s["is_decode_only"]))
    breakdown = {kind: _breakdown([s for s in timer.steps if keep(s)]) for kind, keep in kinds}
    headers = ["stage"] + [f"{kind} {unit}" for kind in breakdown for unit in ("ms/step", "share")]
    rows = [[stage] + [v for b in breakdown.values()
                       for v in (b["ms_per_step"].get(stage), _pct(b["share"].get(stage)))]
            for stage in (*STAGES, "step")]
    rows.append(["steps"] + [v for b in breakdown.values() for v in (b["num_steps"], None)])
    title = f"step time by stage, {n} requests at once, {workload['output_len']} tokens each"
    table = common.print_table(f"{title}, dtype {info['dtype']}", headers, rows)
    outside = {kind: b["outside_forward"] for kind, b in breakdown.items()}
    print("\noutside ModelRunner.run (bar: under 10%): "
          + ", ".join(f"{kind} {_pct(v)}" for kind, v in outside.items()))

    engine = common.new_engine(loaded)
    profiler = cProfile.Profile()
    profiler.enable()
    common.run_tinymlx(engine, prompts, params, desc="profiled pass")
    profiler.disable()
    profile = _summarize_profile(profiler)
    print(f"\n{PROFILE_NOTE}")
    for key, title in (("by_cumulative", "cumulative"), ("by_self", "self (tottime)")):
        headers = ["function", "calls", "self s", "cumulative s"]
        rows = [[f["function"], f["calls"], f["self_s"], f["cumulative_s"]] for f in profile[key]]
        common.print_table(f"cProfile, top {TOP_N} by {title} time", headers, rows)

    payload = {"workload": {**workload, "seed": args.seed}, "results": common.summarize(run),
               "outside_forward_fraction": outside, "breakdown": breakdown, "table": table,
               "profile": profile, "steps": timer.steps}
    common.save_results("overhead", args.quick, info, payload, _plot(timer.steps))


def _breakdown(steps: list[dict]) -> dict:
    if not steps:
        return {"num_steps": 0, "ms_per_step": {}, "share": {}, "outside_forward": None}
    total = sum(s["step_s"] for s in steps)
    per_stage = {stage: sum(s["stages_s"][stage] for s in steps) for stage in STAGES}
    forward = per_stage["forward: inputs + graph"] + per_stage["forward: mx.eval"]
    return {
        "num_steps": len(steps),
        "ms_per_step": {**{k: 1e3 * v / len(steps) for k, v in per_stage.items()},
                        "step": 1e3 * total / len(steps)},
        "share": {**{k: v / total for k, v in per_stage.items()}, "step": 1.0},
        "outside_forward": 1 - forward / total,
    }


def _pct(x: float | None) -> str | None:
    return None if x is None else f"{x:.1%}"


def _summarize_profile(profiler: cProfile.Profile) -> dict:
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_, num_calls, self_s, cumulative_s, _) in stats.stats.items():
        where = name if filename == "~" else f"{_short(filename)}:{line}({name})"
        rows.append({"function": where, "calls": num_calls, "self_s": self_s, "cumulative_s": cumulative_s})
    return {
        "note": PROFILE_NOTE,
        "total_s": stats.total_tt,
        "by_cumulative": sorted(rows, key=lambda r: -r["cumulative_s"])[:TOP_N],
        "by_self": sorted(rows, key=lambda r: -r["self_s"])[:TOP_N],
    }


def _short(filename: str) -> str:
    """Paths from the package down: tinymlx/engine/engine.py, mlx/nn/layers/linear.py."""
    parts = Path(filename).parts
    for root in ("tinymlx", "mlx", "site-packages", "benchmarks"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root) - 1:])
    return Path(filename).name


def _plot(steps: list[dict]) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5))
    host = [stage for stage in STAGES if stage != "forward: mx.eval"]
    bottom = np.zeros(len(steps))
    for stage in host:
        ms = np.array([1e3 * s["stages_s"][stage] for s in steps])
        left.bar(range(len(steps)), ms, bottom=bottom, width=1.0, label=stage)
        bottom += ms
    left.set_xlabel("step (prefill steps come first)")
    left.set_ylabel("ms")
    left.set_title("host-side time per step (everything but the forward's mx.eval)")
    left.legend(fontsize=8)
    forward = [s["stages_s"]["forward: inputs + graph"] + s["stages_s"]["forward: mx.eval"] for s in steps]
    outside = [100 * (1 - f / s["step_s"]) for f, s in zip(forward, steps)]
    right.plot(outside, ".-", label="outside ModelRunner.run")
    right.axhline(10, color="red", linestyle="--", label="bar: 10%")
    right.set_xlabel("step")
    right.set_ylabel("% of step time")
    right.set_title("share of each step outside the model forward")
    right.legend()
    return fig


if __name__ == "__main__":
    main()
