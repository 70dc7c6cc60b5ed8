"""Pipeline parallelism: PP=2 against one process and TP=2 on the real model, on this machine's loopback, and
again with link latency added to every message the ranks send.

At each concurrency N, N requests arrive at once (U[32, 256]-token prompts of real text, greedy, EOS ignored);
each run is a fresh process, so every parallel run starts its own ranks. Measured: generated tok/s, mean TTFT,
the bytes each rank sends per step (TP: what it puts into the collectives; PP: rank 0 the steps' inputs, the
worker its hidden states) and PP's bubble (the stages' idle share of the time). mlx-lm's BatchGenerator runs the
same prompts in one process, in the same run, as the reference for the ratios.

Latency: benchmarks/native/link_delay.c (LD_PRELOAD, built here with the system's C compiler) makes every
message a rank sends over a socket leave late by the given microseconds: MLX's ring (TP) and the pipeline's TCP
links alike; loopback itself adds about 10 microseconds. The sender waits out the delay, where a real link would
let it compute meanwhile: an upper bound on what the latency costs either.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import common
import numpy as np
import vs_mlx_lm
from matplotlib import pyplot as plt

from tinymlx import Engine, EngineConfig

WORKLOADS = {
    "full": {"concurrency": [1, 16], "prompt_len": (32, 256), "output_len": 64, "delays_us": [0, 1000, 5000]},
    "quick": {"concurrency": [1, 4], "prompt_len": (32, 64), "output_len": 8, "delays_us": [0, 1000]},
}
LAYOUTS = {"one process": {}, "PP=2": {"pipeline_parallel_size": 2}, "TP=2": {"tensor_parallel_size": 2}}
SHIM = Path(__file__).resolve().parent / "native" / "link_delay.c"


def main() -> None:
    setup = common.start_process_per_run(__doc__, WORKLOADS, _run_job)
    if setup is None:
        return
    args, workload = setup.args, setup.workload
    results: dict[int, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        shim = _build_shim(Path(tmp))
        for n in workload["concurrency"]:
            rng = np.random.default_rng([args.seed, n])
            prompts = common.sample_prompts(setup.text_ids, n, workload["prompt_len"], rng)
            job = {"model_dir": str(setup.model_dir), "dtype": args.dtype, "prompts": prompts,
                   "max_tokens": workload["output_len"]}
            results[n] = {}
            print(f"\n== N={n}: mlx-lm", file=sys.stderr)
            results[n]["mlx-lm"] = common.run_in_fresh_process(__file__, {**job, "engine": "mlx-lm"},
                                                              Path(tmp) / f"mlx-lm-{n}.json")
            for layout, sizes in LAYOUTS.items():
                for delay in workload["delays_us"] if sizes else [0]:  # one process sends nothing
                    if delay and shim is None:
                        continue
                    key = layout if not sizes else f"{layout}, +{delay} us"
                    print(f"\n== N={n}: {key}", file=sys.stderr)
                    env = {**os.environ, "LINK_DELAY_US": str(delay)}
                    if delay:
                        env["LD_PRELOAD"] = f"{env.get('LD_PRELOAD', '')}:{shim}".lstrip(":")
                    results[n][key] = common.run_in_fresh_process(
                        __file__, {**job, "engine": "tinymlx", "sizes": sizes}, Path(tmp) / f"{len(results[n])}-{n}.json",
                        env=env)
        for n, by_key in results.items():  # the layouts change how the forward is computed, never what
            tokens = {key: r.pop("token_ids") for key, r in by_key.items() if "token_ids" in r}
            assert all(t == tokens["one process"] for t in tokens.values()), f"a layout's tokens differ at N={n}"

    table = _table(results)
    payload = {"workload": {**workload, "seed": args.seed}, "results": results, "table": table,
               "link_delay": "benchmarks/native/link_delay.c" if shim else "no C compiler: no latency rows"}
    common.save_results("pipeline", args.quick, setup.info, payload, _plot(results))


def _build_shim(directory: Path) -> Path | None:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None or sys.platform != "linux":  # LD_PRELOAD: Linux's dynamic linker
        return None
    shim = directory / "link_delay.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(shim), str(SHIM), "-ldl"], check=True)
    return shim


# -- one run in one process -----------------------------------------------------------------------
def _run_job(job: dict) -> dict:
    if job["engine"] == "mlx-lm":
        return vs_mlx_lm.run_mlx_lm({**job, "with_stream": False})[vs_mlx_lm.BATCH]
    engine = Engine.from_config(EngineConfig(model=job["model_dir"], dtype=job["dtype"], **job["sizes"]), progress=False)
    try:
        common.run_tinymlx(engine, [list(range(100, 108))], [common.fixed_length(4)], desc="warm-up")
        before = engine.stats()
        params = [common.fixed_length(job["max_tokens"])] * len(job["prompts"])
        run = common.run_tinymlx(engine, job["prompts"], params, desc=f"{job['sizes'] or 'one process'}")
        stats = engine.stats()
    finally:
        engine.close()
    steps = stats.num_steps - before.num_steps
    out = {**common.summarize(run), "token_ids": [o.token_ids for o in run.outputs], "num_steps": steps}
    if stats.pipeline is not None:
        first = {stage.index: stage for stage in before.pipeline.stages}
        out["bytes_per_step_by_rank"] = [  # rank 0 runs the last stage
            (stage.sent_bytes_total - first[stage.index].sent_bytes_total) / steps for stage in reversed(stats.pipeline.stages)]
        out["bubble_fraction"] = stats.pipeline.bubble_fraction
    elif stats.tensor_parallel_size > 1:
        comm = stats.comm_total
        before_comm = before.comm_total
        sent = (comm.all_reduce_bytes + comm.all_gather_bytes + comm.broadcast_bytes
                - before_comm.all_reduce_bytes - before_comm.all_gather_bytes - before_comm.broadcast_bytes)
        out["bytes_per_step_by_rank"] = [sent / steps] * stats.tensor_parallel_size  # each rank puts in as much
    return out


# -- table and plot ------------------------------------------------------------------------------
def _table(results: dict[int, dict[str, dict]]) -> dict:
    headers = ["N", "layout", "gen tok/s", "x one process", "x mlx-lm", "mean TTFT s", "KB/step by rank", "bubble"]
    rows = []
    for n, by_key in results.items():
        one, peer = by_key["one process"], by_key["mlx-lm"]
        for key, r in by_key.items():
            sent = r.get("bytes_per_step_by_rank")
            rows.append([n, key, r["gen_tok_s"], r["gen_tok_s"] / one["gen_tok_s"], r["gen_tok_s"] / peer["gen_tok_s"],
                         r["mean_ttft_s"], " / ".join(f"{b / 1e3:.1f}" for b in sent) if sent else "-",
                         f"{r['bubble_fraction']:.0%}" if "bubble_fraction" in r else "-"])
    return common.print_table("PP=2 and TP=2 against one process (ranks share this machine's cores; link latency "
                              "added to every send)", headers, rows)


def _plot(results: dict[int, dict[str, dict]]) -> plt.Figure:
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, (n, by_key) in zip(axes[0], results.items()):
        for layout in ("PP=2", "TP=2"):
            points = sorted((int(key.split("+")[1].split()[0]), r["gen_tok_s"]) for key, r in by_key.items()
                            if key.startswith(layout))
            ax.plot([d / 1e3 for d, _ in points], [rate for _, rate in points], marker="o", label=layout)
        ax.axhline(by_key["one process"]["gen_tok_s"], color="gray", linestyle="--", label="one process")
        ax.axhline(by_key["mlx-lm"]["gen_tok_s"], color="#c8a040", linestyle=":", label="mlx-lm (one process)")
        ax.set_xlabel("latency added to each message, ms")
        ax.set_ylabel("generated tok/s")
        ax.set_title(f"N={n} requests at once")
        ax.legend()
    fig.suptitle("Where pipeline parallelism overtakes tensor parallelism as the link slows")
    return fig


if __name__ == "__main__":
    main()
