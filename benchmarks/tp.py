"""Tensor parallelism: TP=1 vs TP=2 on the real model, at concurrency 1 and 16, on this one machine.

At each concurrency N, N requests arrive at once (U[32, 256]-token prompts of real text, greedy, EOS
ignored); each (TP, N) runs in a fresh process, so every TP=2 run starts its own ranks. Measured:
generated and prefill tok/s and TTFT; at TP=2 the collectives and bytes per step and per token,
and the share of step time spent in communication: every step's collectives (all-reduces of
[tokens, hidden], the all-gather of the sampled rows' logits, the two broadcasts), each timed on the
live ring at its own shape (median of probes with both ranks otherwise idle), over the step's wall
time. Waits for the slower rank are not in that share; the TP=2 / TP=1 time is.
Also measured: the lm_head choice (vocab-sharded plus a gather of logits vs replicated on rank 0).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import common
import mlx.core as mx
import numpy as np
from matplotlib import pyplot as plt

from tinymlx import Engine, EngineConfig
from tinymlx.core.outputs import CommCounts

WORKLOADS = {
    "full": {"concurrency": [1, 16], "prompt_len": (32, 256), "output_len": 64, "probe_repeats": 15},
    "quick": {"concurrency": [1, 4], "prompt_len": (32, 64), "output_len": 8, "probe_repeats": 3},
}
SIZES = (1, 2)


def main() -> None:
    setup = common.start_process_per_run(__doc__, WORKLOADS, _run_job)
    if setup is None:
        return
    args, workload = setup.args, setup.workload
    results: dict[int, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in workload["concurrency"]:
            rng = np.random.default_rng([args.seed, n])
            prompts = common.sample_prompts(setup.text_ids, n, workload["prompt_len"], rng)
            results[n] = {}
            for size in SIZES:
                job = {"model_dir": str(setup.model_dir), "dtype": args.dtype, "prompts": prompts, "size": size,
                       "max_tokens": workload["output_len"], "probe_repeats": workload["probe_repeats"]}
                print(f"\n== N={n}: TP={size}", file=sys.stderr)
                results[n][size] = common.run_in_fresh_process(__file__, job, Path(tmp) / f"tp{size}-{n}.json")
        for n in workload["concurrency"]:  # TP changes only how the forward is computed
            assert results[n][1]["token_ids"] == results[n][2]["token_ids"], f"TP=2 output differs at N={n}"

    table = _table(results)
    payload = {"workload": {**workload, "seed": args.seed}, "results": _without_tokens(results), "table": table}
    common.save_results("tp", args.quick, setup.info, payload, _plot(results))


# -- one (TP, N) in one process -------------------------------------------------------------------
def _run_job(job: dict) -> dict:
    config = EngineConfig(model=job["model_dir"], dtype=job["dtype"], tensor_parallel_size=job["size"])
    engine = Engine.from_config(config, progress=False)
    common.run_tinymlx(engine, [list(range(100, 108))], [common.fixed_length(4)], desc="warm-up")
    steps = _time_steps(engine)
    params = [common.fixed_length(job["max_tokens"])] * len(job["prompts"])
    run = common.run_tinymlx(engine, job["prompts"], params, desc=f"TP={job['size']} N={len(params)}")
    out = {**common.summarize(run), "token_ids": [o.token_ids for o in run.outputs],
           "step_s": float(sum(s[0] for s in steps)), "num_steps": len(steps)}
    if job["size"] > 1:
        out.update(_communication(engine, steps, run, job["probe_repeats"]))
    engine.close()
    return out


def _time_steps(engine: Engine) -> list[tuple[float, int, CommCounts]]:
    """Record (seconds, batched tokens, collectives) of every step from now on."""
    steps, step = [], engine.step

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        stats = engine.stats()
        steps.append((time.perf_counter() - start, stats.num_batched_tokens, stats.comm_last_step))
        return outputs

    engine.step = timed_step
    return steps


def _communication(engine: Engine, steps: list[tuple[float, int, CommCounts]], run: common.Run,
                   repeats: int) -> dict:
    """Each step's collectives, each timed by a probe of its own shape on the live ring, over step time."""
    ranks, args = engine.runner.ranks, engine.runner.model.args
    itemsize = engine.runner.kv_cache.layout.dtype.size
    vocab_slice = args.vocab_size // ranks.size
    shapes = []  # per step: (calls, rows, columns) of its all-reduces, all-gather and broadcasts
    for _, tokens, comm in steps:
        sampled_rows = comm.all_gather_bytes // (vocab_slice * itemsize)
        payload_columns = max(1, (comm.broadcast_bytes - 8) // 4)  # after the 2-int header
        shapes.append([(comm.num_all_reduces, tokens, args.hidden_size), (comm.num_all_gathers, sampled_rows, vocab_slice),
                       (1, 1, 2), (1, 1, payload_columns)])
    probe = {(rows, columns): float(np.median(ranks.probe_all_reduce(rows, columns, repeats)))
             for step in shapes for calls, rows, columns in step if calls and rows}
    comm_s = sum(calls * probe[rows, columns] for step in shapes for calls, rows, columns in step if calls and rows)
    num_tokens = sum(tokens for _, tokens, _ in steps)
    bytes_per_token = 2 * args.num_hidden_layers * args.hidden_size * itemsize
    return {
        "comm_share": comm_s / sum(s for s, _, _ in steps),
        "comm_s": comm_s,
        "all_reduces_per_step": Counter(comm.num_all_reduces for _, _, comm in steps).most_common(1)[0][0],
        "all_reduce_bytes_per_token": bytes_per_token,
        "all_gather_bytes_per_sampled_row": vocab_slice * itemsize,
        "bytes_per_generated_token": sum(
            c.all_reduce_bytes + c.all_gather_bytes + c.broadcast_bytes for _, _, c in steps
        ) / sum(r.num_output_tokens for r in run.requests),
        "num_tokens": num_tokens,
        "probe_s": {f"{rows}x{columns}": t for (rows, columns), t in probe.items()},
        "broadcast_bytes_per_step": float(np.mean([c.broadcast_bytes for _, _, c in steps])),
        "lm_head": _lm_head_choice(engine, repeats),
    }


def _lm_head_choice(engine: Engine, repeats: int) -> dict:
    """Why the lm_head is vocab-sharded: per step, rank 0 computing the whole head alone (replicated)
    vs each rank computing half the vocabulary, then gathering the halves (at 1 and 16 sampled rows).
    The whole head is timed as a matmul of its shape, made of this rank's half twice."""
    model, ranks = engine.runner.model, engine.runner.ranks
    if model.args.tie_word_embeddings:
        half = model.model.embed_tokens.weight[model._vocab_rows].T
    else:
        half = model.lm_head.weight_t if hasattr(model.lm_head, "weight_t") else model.lm_head.weight.T
    half = mx.contiguous(half)  # [hidden, vocab / 2], the layout the engine multiplies by
    whole = mx.contiguous(mx.concatenate([half, half], axis=1))
    choice = {}
    for rows in (1, 16):
        x = mx.random.normal((rows, model.args.hidden_size))
        mx.eval(x, half, whole)
        replicated = _median_s(lambda x=x: mx.eval(x @ whole), repeats)
        sharded = _median_s(lambda x=x: mx.eval(x @ half), repeats)
        # Gathering [rows, vocab / 2] from each rank moves the bytes of an all-reduce of that shape.
        gather = float(np.median(ranks.probe_all_reduce(rows, half.shape[1], repeats)))
        choice[str(rows)] = {"replicated_s": replicated, "sharded_matmul_s": sharded, "gather_s": gather,
                             "sharded_s": sharded + gather}
    return choice


def _median_s(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _without_tokens(results: dict) -> dict:
    return {n: {size: {k: v for k, v in r.items() if k != "token_ids"} for size, r in by_size.items()}
            for n, by_size in results.items()}


# -- table and plot ------------------------------------------------------------------------------
def _table(results: dict) -> dict:
    headers = ["N", "TP", "gen tok/s", "prefill tok/s", "mean TTFT s", "x TP=1", "comm share",
               "all-reduces/step", "KB/token"]
    rows = []
    for n, by_size in results.items():
        for size, r in by_size.items():
            parallel = size > 1
            rows.append([n, size, r["gen_tok_s"], r["prefill_tok_s"], r["mean_ttft_s"],
                         r["gen_tok_s"] / by_size[1]["gen_tok_s"],
                         f"{r['comm_share']:.1%}" if parallel else "-",
                         r["all_reduces_per_step"] if parallel else "-",
                         r["all_reduce_bytes_per_token"] / 1e3 if parallel else "-"])
    return common.print_table("TP=1 vs TP=2 (ranks share this machine's cores)", headers, rows)


def _plot(results: dict) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ns = list(results)
    width = 0.38
    for k, size in enumerate(SIZES):
        rates = [results[n][size]["gen_tok_s"] for n in ns]
        bars = left.bar(np.arange(len(ns)) + (k - 0.5) * width, rates, width, label=f"TP={size}")
        left.bar_label(bars, fmt="%.1f")
    left.set_xticks(np.arange(len(ns)), [f"N={n}" for n in ns])
    left.set_ylabel("generated tok/s")
    left.set_title("throughput (one machine, ranks share its cores)")
    left.legend()
    shares = [results[n][2]["comm_share"] * 100 for n in ns]
    bars = right.bar([f"N={n}" for n in ns], shares, color="#c8a040")
    right.bar_label(bars, fmt="%.1f%%")
    right.set_ylabel("% of TP=2 step time")
    right.set_title("communication (each collective probed at its shape)")
    return fig


if __name__ == "__main__":
    main()
