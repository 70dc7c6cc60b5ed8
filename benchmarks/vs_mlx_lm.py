"""tinymlx vs mlx-lm side by side, at concurrency 1, 4, 8, 16 and 32.

At each concurrency N, N requests arrive at once: the same token-id prompts (U[32, 256] tokens of
real text) and the same output length for both engines, greedy, EOS ignored. The engines: tinymlx
as it is, mlx-lm's BatchGenerator (what `batch_generate` drives, with its defaults) and, at N = 1,
`mlx_lm.stream_generate`. mlx-lm runs to max_tokens because it is given no stop tokens (BatchGenerator)
or an empty EOS set (stream_generate); a logits processor banning EOS would instead push mlx-lm's
batched decode onto its slower per-row path. Each (engine, N) runs in a fresh process, in turn, so
memory peaks are per run and both engines see the machine's load drift alike.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import common
import mlx.core as mx
import numpy as np
from matplotlib import pyplot as plt
from tqdm import tqdm

from tinymlx.models import resolve_dtype

WORKLOADS = {
    "full": {"concurrency": [1, 4, 8, 16, 32], "prompt_len": (32, 256), "output_len": 64},
    "quick": {"concurrency": [1, 4], "prompt_len": (32, 64), "output_len": 8},
}
TINYMLX, BATCH, STREAM = "tinymlx", "mlx-lm BatchGenerator", "mlx-lm stream_generate"


def main() -> None:
    setup = common.start_process_per_run(__doc__, WORKLOADS, _run_job)
    if setup is None:
        return
    args, workload = setup.args, setup.workload
    results: dict[int, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in workload["concurrency"]:
            rng = np.random.default_rng([args.seed, n])
            prompts = common.sample_prompts(setup.text_ids, n, workload["prompt_len"], rng)
            results[n] = {}
            for engine in ("tinymlx", "mlx-lm"):
                job = {"engine": engine, "model_dir": str(setup.model_dir), "dtype": args.dtype, "prompts": prompts,
                       "max_tokens": workload["output_len"], "with_stream": engine == "mlx-lm" and n == 1}
                print(f"\n== N={n}: {engine}", file=sys.stderr)
                results[n].update(common.run_in_fresh_process(__file__, job, Path(tmp) / f"{engine}-{n}.json"))

    table = _table(results)
    bars = _bars(results)
    print("\n" + "\n".join(f"{k}: {v['measured']:.2f} (bar {v['bar']})" for k, v in bars.items()))
    payload = {"workload": {**workload, "seed": args.seed}, "results": results, "bars": bars, "table": table}
    common.save_results("vs_mlx_lm", args.quick, setup.info, payload, _plot(results))


# -- one engine in one process ------------------------------------------------------------------
def _run_job(job: dict) -> dict:
    return (_run_tinymlx if job["engine"] == "tinymlx" else run_mlx_lm)(job)


def _measured(run: common.Run) -> dict:
    return {**common.summarize(run), "peak_memory_gb": mx.get_peak_memory() / 1e9}


def _run_tinymlx(job: dict) -> dict:
    loaded = common.load_tinymlx(job["model_dir"], job["dtype"])
    common.warm_up(loaded)
    mx.clear_cache()
    mx.reset_peak_memory()
    engine = common.new_engine(loaded)
    params = [common.fixed_length(job["max_tokens"])] * len(job["prompts"])
    summary = _measured(common.run_tinymlx(engine, job["prompts"], params, desc=f"tinymlx N={len(params)}"))
    return {TINYMLX: {**summary, "kv_pool_gb": engine.runner.kv_cache.nbytes / 1e9}}


def run_mlx_lm(job: dict) -> dict:
    # mlx-lm is imported only in its own workers: it pulls in transformers, which tinymlx never loads.
    import mlx_lm

    model, tokenizer = mlx_lm.load(job["model_dir"])
    dtype = resolve_dtype(job["dtype"])
    if dtype != "float32":  # the converted checkpoint is float32; match tinymlx's dtype
        model.set_dtype(getattr(mx, dtype))
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    _batch_generate(model, [prompts[0][:8]], 4)  # warm-up
    out = {}
    for name, run in ((BATCH, _batch_generate), (STREAM, _stream_generate)):
        if name == STREAM and not job["with_stream"]:
            continue
        mx.clear_cache()
        mx.reset_peak_memory()
        out[name] = _measured(run(model, prompts, max_tokens, tokenizer=tokenizer))
    return out


def _batch_generate(model, prompts: list[list[int]], max_tokens: int, tokenizer=None) -> common.Run:
    """batch_generate's loop, timed per request; no stop tokens, so every request runs to max_tokens."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, stop_tokens=None)
    first, done, counts = {}, {}, {}
    t0 = time.perf_counter()
    uids = generator.insert(prompts, [max_tokens] * len(prompts))
    with tqdm(total=max_tokens * len(prompts), desc=f"BatchGenerator N={len(prompts)}", leave=False) as bar:
        while len(done) < len(uids):
            _, responses = generator.next()
            now = time.perf_counter() - t0
            for r in responses:
                first.setdefault(r.uid, now)
                counts[r.uid] = counts.get(r.uid, 0) + 1
                if r.finish_reason is not None:
                    done[r.uid] = now
            bar.update(len(responses))
    makespan = time.perf_counter() - t0
    generator.close()
    timings = [_timing(len(p), counts[u], max_tokens, first[u], done[u]) for p, u in zip(prompts, uids)]
    return common.Run(timings, makespan)


def _stream_generate(model, prompts: list[list[int]], max_tokens: int, tokenizer=None) -> common.Run:
    from mlx_lm import stream_generate

    (prompt,) = prompts
    tokenizer.eos_token_ids = set()  # never stop at EOS: run to max_tokens, as ignore_eos does
    count, first = 0, None
    t0 = time.perf_counter()
    for _ in tqdm(stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens),
                  total=max_tokens, desc="stream_generate", leave=False):
        first = first or time.perf_counter() - t0
        count += 1
    makespan = time.perf_counter() - t0
    return common.Run([_timing(len(prompt), count, max_tokens, first, makespan)], makespan)


def _timing(num_prompt: int, num_output: int, expected: int, ttft: float, e2e: float) -> common.RequestTiming:
    if num_output != expected:
        raise RuntimeError(f"mlx-lm generated {num_output} tokens, expected {expected}")
    return common.RequestTiming(num_prompt, num_output, ttft, e2e)


# -- report -------------------------------------------------------------------------------------
def _table(results: dict[int, dict[str, dict]]) -> dict:
    """One row per (N, engine); each mlx-lm row carries tinymlx's ratio against it."""
    headers = ["N", "engine", "gen tok/s", "prefill tok/s", "decode tok/s/stream", "mean TTFT s",
               "p99 TTFT s", "peak GB", "x gen tok/s", "x decode", "x mean TTFT", "x peak mem"]
    rows = []
    for n, engines in results.items():
        ours = engines[TINYMLX]
        for name, s in engines.items():
            ratios = [None] * 4
            if name != TINYMLX:
                ratios = [ours["gen_tok_s"] / s["gen_tok_s"],
                          _ratio(ours["decode_tok_s_per_stream"], s["decode_tok_s_per_stream"]),
                          ours["mean_ttft_s"] / s["mean_ttft_s"],
                          ours["peak_memory_gb"] / s["peak_memory_gb"]]
            rows.append([n, name, s["gen_tok_s"], s["prefill_tok_s"], s["decode_tok_s_per_stream"],
                         s["mean_ttft_s"], s["p99_ttft_s"], s["peak_memory_gb"], *ratios])
    title = "tinymlx vs mlx-lm (x = tinymlx / that mlx-lm row; TTFT and memory: lower is better)"
    return common.print_table(title, headers, rows)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _bars(results: dict[int, dict[str, dict]]) -> dict:
    """The issue's bars, for the concurrencies this run covered."""
    bars = {}
    for n in (8, 16, 32):
        if n in results:
            r = results[n]
            bars[f"gen tok/s at N={n}, tinymlx/BatchGenerator"] = {
                "measured": r[TINYMLX]["gen_tok_s"] / r[BATCH]["gen_tok_s"], "bar": ">= 1.3"}
    if 1 in results and STREAM in results[1]:
        r = results[1]
        bars["single-stream decode tok/s, tinymlx/stream_generate"] = {
            "measured": r[TINYMLX]["decode_tok_s_per_stream"] / r[STREAM]["decode_tok_s_per_stream"],
            "bar": ">= 0.95"}
    if 32 in results:
        r = results[32]
        bars["mean TTFT at N=32, tinymlx/BatchGenerator"] = {
            "measured": r[TINYMLX]["mean_ttft_s"] / r[BATCH]["mean_ttft_s"], "bar": "<= 0.5"}
    return bars


def _plot(results: dict[int, dict[str, dict]]) -> plt.Figure:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    metrics = (("gen_tok_s", "generated tok/s (aggregate)"), ("mean_ttft_s", "mean TTFT (s)"),
               ("peak_memory_gb", "peak memory (GB)"))
    levels = list(results)
    for ax, (key, label) in zip(axes, metrics):
        for name, style in ((TINYMLX, "o-"), (BATCH, "s--"), (STREAM, "^")):
            points = [(n, results[n][name][key]) for n in levels if name in results[n]]
            if points:
                ax.plot(*zip(*points), style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    return fig


if __name__ == "__main__":
    main()
