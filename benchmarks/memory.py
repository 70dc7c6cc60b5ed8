"""Memory: weights per dtype, int8 K/V, the prefix cache's disk tier, and peak memory of a burst, against mlx-lm.

Every measurement runs in a fresh process (so peaks and caches are its own), one after the other:
- weights: the model loaded as float32, bfloat16, native (the GGUF's own quantization), q8 and q4 (MLX's
  quantization of the float weights, groups of 64); the bytes its parameters take, against the GGUF file,
  and single-stream decode tok/s (a 128-token prompt, 32 tokens out). mlx-lm loads the same float32
  directory (float32, bfloat16, and nn.quantize at 8 and 4 bits, its own defaults) with stream_generate.
- int8 K/V: the same prompts greedy with kv_cache_dtype "auto" and "int8" in one process: how many
  tokens agree before the first difference, the largest difference of the chosen tokens' logprobs where
  they agree, and decode tok/s of one stream on a 2,000-token context and of an 8-request burst.
- the disk tier: benchmarks/disk_cache.py's three processes (cold; cold writing the tier; a new process
  warm from disk) on a 4,000-token prompt, one token out.
- a 16-request burst (prompts U[32, 256] of real text, 64 tokens out, greedy, EOS ignored), tinymlx's
  Engine with its default pool against mlx-lm's BatchGenerator: the process's resident set, sampled
  every 20 ms during the burst (its peak), and MLX's own peak of allocated memory.
Bars: native weights at most 1.3x the file; disk-warm TTFT at most 0.35x cold; the burst's peak RSS at
most 1.1x mlx-lm's.

The budget (`--only budget`, its results in results/memory_budget.{json,png}): at a 4 GB memory budget
(`memory_budget_bytes`: every pool and the largest step's activations), for the 0.5B, Gemma 3 270M and the
Qwen3.5-0.8B-shaped hybrid (hybrid.py's random checkpoint, written once), all float32: the budget's
parts, the longest context that fits (alone, each of 4, each of 16), and MLX's peak (mx.get_peak_memory()
from before the weights load) of two workloads against weights + budget: a long prompt in chunks (8,192
tokens; quick: 1,024) and 16 concurrent chats (prompts U[64, 256], 32 tokens out). mlx-lm's peak on the
same long prompt, loaded from the same directory, beside each model's when mlx-lm is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import common
import disk_cache
import hybrid
import mlx.core as mx
import numpy as np
from matplotlib import pyplot as plt
from vs_mlx_lm import _batch_generate, _stream_generate

from tinymlx import Engine, EngineConfig, SamplingParams
from tinymlx.loader import OFFLINE_MODELS, resolve_model_dir
from tinymlx.models import load_model
from tinymlx.text.tokenizer import Tokenizer

WORKLOADS = {
    "full": {"decode_tokens": 32, "kv_prompts": 6, "kv_tokens": 48, "long_context": 2000, "burst": 16,
             "burst_tokens": 64, "disk_prompt_tokens": 4000},
    "quick": {"decode_tokens": 8, "kv_prompts": 2, "kv_tokens": 12, "long_context": 300, "burst": 4,
              "burst_tokens": 8, "disk_prompt_tokens": 500},
}
TINYMLX_DTYPES = ("float32", "bfloat16", "native", "q8", "q4")
MLX_LM_DTYPES = ("float32", "bfloat16", "q8", "q4")
NATIVE_BAR, DISK_BAR, RSS_BAR = 1.3, 0.35, 1.1


BUDGET_BYTES = 4 * 10**9
BUDGET_MODELS = ("qwen2.5-coder-0.5b-instruct", "gemma-3-270m", "qwen3.5-0.8b-shaped")
BUDGET_WORKLOADS = {"full": {"long_prompt": 8192, "chats": 16, "chat_tokens": 32},
                    "quick": {"long_prompt": 1024, "chats": 4, "chat_tokens": 8}}


# -- one measurement per process -------------------------------------------------------------------
def run_job(job: dict) -> dict:
    return {"weights": _weights, "kv": _kv_dtypes, "burst": _burst, "budget": _budget}[job["kind"]](job)


def _weights(job: dict) -> dict:
    dtype, prompt = job["dtype"], job["prompt"]
    start = time.perf_counter()
    if job["engine"] == "mlx-lm":
        import mlx.nn as nn
        import mlx_lm

        model, tokenizer = mlx_lm.load(job["float32_dir"])
        if dtype == "bfloat16":
            model.set_dtype(mx.bfloat16)
        elif dtype in ("q8", "q4"):
            nn.quantize(model, bits=int(dtype[1:]))  # mlx-lm's defaults: groups of 64
        mx.eval(model.parameters())
        load_s = time.perf_counter() - start
        run = _stream_generate(model, [prompt], job["decode_tokens"], tokenizer=tokenizer)
        weights = _nbytes(model.parameters())
    else:
        model_dir = resolve_model_dir(job["model"], progress=False, dtype=dtype)
        model = load_model(model_dir, dtype)
        load_s = time.perf_counter() - start
        engine = Engine(model, Tokenizer.from_dir(model_dir), EngineConfig(num_pages=64))
        common.run_tinymlx(engine, [prompt[:8]], [common.fixed_length(2)], desc="warm-up")
        run = common.run_tinymlx(engine, [prompt], [common.fixed_length(job["decode_tokens"])], desc=dtype)
        weights = engine.weights_bytes
    decode = common.summarize(run)["decode_tok_s_per_stream"]
    return {"weights_bytes": weights, "load_s": load_s, "decode_tok_s": decode}


def _nbytes(tree) -> int:
    from mlx.utils import tree_flatten

    return sum(array.nbytes for _, array in tree_flatten(tree))


def _kv_dtypes(job: dict) -> dict:
    loaded = common.load_tinymlx(job["model"], "float32")
    common.warm_up(loaded)
    params = SamplingParams(temperature=0, max_tokens=job["kv_tokens"], ignore_eos=True, logprobs=0)
    out = {}
    for kv_cache_dtype in ("auto", "int8"):
        engine = common.new_engine(loaded, kv_cache_dtype=kv_cache_dtype)
        replies = common.run_tinymlx(engine, job["prompts"], [params] * len(job["prompts"]), desc=kv_cache_dtype).outputs
        long = common.run_tinymlx(common.new_engine(loaded, kv_cache_dtype=kv_cache_dtype), [job["long_prompt"]],
                                  [common.fixed_length(job["decode_tokens"])], desc=f"{kv_cache_dtype} long")
        burst = common.run_tinymlx(common.new_engine(loaded, kv_cache_dtype=kv_cache_dtype), job["burst_prompts"],
                                   [common.fixed_length(job["burst_tokens"])] * len(job["burst_prompts"]),
                                   desc=f"{kv_cache_dtype} burst")
        out[kv_cache_dtype] = {
            "tokens": [r.token_ids for r in replies], "logprobs": [[lp.logprob for lp in r.logprobs] for r in replies],
            "long_context_decode_tok_s": common.summarize(long)["decode_tok_s_per_stream"],
            "burst_gen_tok_s": common.summarize(burst)["gen_tok_s"],
            "kv_bytes_per_block": engine.runner.kv_cache.page_nbytes,
        }
    return out


def _burst(job: dict) -> dict:
    sampler = _RSSSampler()
    if job["engine"] == "mlx-lm":
        import mlx_lm

        model, _ = mlx_lm.load(job["float32_dir"])
        _batch_generate(model, [job["prompts"][0][:8]], 2)  # warm-up
        mx.clear_cache()
        mx.reset_peak_memory()
        with sampler:
            run = _batch_generate(model, job["prompts"], job["burst_tokens"])
    else:
        loaded = common.load_tinymlx(job["model"], "float32")
        common.warm_up(loaded)
        mx.clear_cache()
        mx.reset_peak_memory()
        with sampler:
            engine = common.new_engine(loaded)  # the default pool: a budget its arrays grow to
            run = common.run_tinymlx(engine, job["prompts"], [common.fixed_length(job["burst_tokens"])] * len(job["prompts"]))
    return {**common.summarize(run), "peak_rss_bytes": sampler.peak, "mlx_peak_bytes": mx.get_peak_memory()}


def _budget(job: dict) -> dict:
    """One model at the budget: its parts and what fits, then MLX's peak over one workload, counted from
    before the weights load, against weights + budget (mlx-lm: its peak on the same prompt)."""
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    if job["engine"] == "mlx-lm":
        import mlx_lm

        model, tokenizer = mlx_lm.load(job["model_dir"])
        _stream_generate(model, job["prompts"], job["max_tokens"], tokenizer=tokenizer)
        return {"peak_bytes": mx.get_peak_memory() - before}
    model_dir = Path(job["model_dir"])
    model, tokenizer = load_model(model_dir, "float32"), Tokenizer.from_dir(model_dir)
    engine = Engine(model, tokenizer, EngineConfig(memory_budget_bytes=BUDGET_BYTES, max_num_seqs=16))
    start = time.perf_counter()
    run = common.run_tinymlx(engine, job["prompts"], [common.fixed_length(job["max_tokens"])] * len(job["prompts"]),
                             desc=f"{job['model']} {job['workload']}")
    mx.synchronize()
    stats = engine.stats()
    return {"peak_bytes": mx.get_peak_memory() - before, "weights_bytes": stats.weights_bytes,
            "memory_budget_bytes": stats.memory_budget_bytes, "pools_bytes_budget": stats.pools_bytes_budget,
            "activation_bytes_budget": stats.activation_bytes_budget, "longest_context": stats.longest_context,
            "num_steps": stats.num_steps, "seconds": time.perf_counter() - start,
            "ttft_s": common.summarize(run)["mean_ttft_s"]}


class _RSSSampler:
    """The process's resident set, read from /proc every 20 ms while the block runs; `peak` after it."""

    def __init__(self) -> None:
        self.peak, self._done = 0, threading.Event()

    def _read(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, self._read())

    def __enter__(self):
        self.peak = self._read()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())


# -- the parent ------------------------------------------------------------------------------------
def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: a job file to run in this process
    parser.add_argument("--only", choices=("budget",), help="run only the budget's rows (needs no mlx-lm)")
    if common.run_worker(parser.parse_known_args()[0], run_job):
        return
    setup = common.setup(__doc__, WORKLOADS, parser)
    if setup.args.only == "budget":
        _budget_rows(setup)
        return
    w, text, rng = setup.workload, setup.text_ids, np.random.default_rng(0)
    model = setup.args.model or "qwen2.5-coder-0.5b-instruct"
    gguf_bytes = OFFLINE_MODELS[model].size if model in OFFLINE_MODELS else None
    float32_dir = str(resolve_model_dir(model, dtype="float32"))
    directory = Path(tempfile.mkdtemp(prefix="tinymlx-memory-"))
    base = {"model": model, "float32_dir": float32_dir, **w}
    prompt = text[:128]

    def fresh(job: dict, name: str) -> dict:
        print(f"== {name}", flush=True)
        return common.run_in_fresh_process(__file__, {**base, **job}, directory / f"{name}.json")

    try:
        weights = {("tinymlx", d): fresh({"kind": "weights", "engine": "tinymlx", "dtype": d, "prompt": prompt},
                                         f"weights-tinymlx-{d}") for d in TINYMLX_DTYPES}
        weights.update({("mlx-lm", d): fresh({"kind": "weights", "engine": "mlx-lm", "dtype": d, "prompt": prompt},
                                             f"weights-mlx-lm-{d}") for d in MLX_LM_DTYPES})
        kv = fresh({"kind": "kv", "prompts": common.sample_prompts(text, w["kv_prompts"], (64, 256), rng),
                    "long_prompt": text[:w["long_context"]],
                    "burst_prompts": common.sample_prompts(text, 8, (32, 256), rng)}, "kv")
        burst_prompts = common.sample_prompts(text, w["burst"], (32, 256), rng)
        burst = {engine: fresh({"kind": "burst", "engine": engine, "prompts": burst_prompts}, f"burst-{engine}")
                 for engine in ("tinymlx", "mlx-lm")}
        disk = _disk_tier(setup, w["disk_prompt_tokens"], directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    _report(setup, model, gguf_bytes, weights, kv, burst, disk)


def _budget_rows(setup: common.Setup) -> None:
    w = BUDGET_WORKLOADS["quick" if setup.args.quick else "full"]
    text, rng = setup.text_ids, np.random.default_rng(0)
    long_prompt = (text * (1 + w["long_prompt"] // len(text)))[:w["long_prompt"]]
    workloads = {"long prompt": ([long_prompt], 4), f"{w['chats']} chats": (
        common.sample_prompts(text, w["chats"], (64, 256), rng), w["chat_tokens"])}
    directory = Path(tempfile.mkdtemp(prefix="tinymlx-memory-budget-"))
    engines = ["tinymlx"] + ["mlx-lm"] * _has_mlx_lm()
    results = {}
    try:
        for model in BUDGET_MODELS:
            # The hybrid from hybrid.py's checkpoint (its tokenizer the default model's): both engines load
            # the same float32 weights from one directory.
            model_dir = str(hybrid.ensure_checkpoint(resolve_model_dir(None)) if model == BUDGET_MODELS[2]
                            else resolve_model_dir(model, dtype="float32"))
            for name, (prompts, max_tokens) in workloads.items():
                for engine in engines if name == "long prompt" else ["tinymlx"]:
                    print(f"== {model}: {name} ({engine})", flush=True)
                    job = {"kind": "budget", "engine": engine, "model": model, "model_dir": model_dir,
                           "workload": name, "prompts": prompts, "max_tokens": max_tokens}
                    results[model, name, engine] = common.run_in_fresh_process(
                        __file__, job, directory / f"budget-{len(results)}.json")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    gb, rows = 1e9, []
    for (model, name, engine), r in results.items():
        if engine == "mlx-lm":
            rows.append([model, name, engine, "-", "-", "-", r["peak_bytes"] / gb, "-", "-"])
            continue
        bound = r["weights_bytes"] + r["memory_budget_bytes"]
        fits = ", ".join(f"{n}: {tokens:,}" for n, tokens in r["longest_context"])
        rows.append([model, name, engine, r["weights_bytes"] / gb, r["pools_bytes_budget"] / gb,
                     r["activation_bytes_budget"] / gb, r["peak_bytes"] / gb, r["peak_bytes"] / bound, fits])
    table = common.print_table(f"At a {BUDGET_BYTES / gb:g} GB memory budget (float32)", [
        "model", "workload", "engine", "weights GB", "pools GB", "activations GB", "MLX peak GB",
        "peak / (weights + budget)", "longest context (alone, 4, 16 at once)"], rows)
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{m}\n{n}\n{e}" for m, n, e in results]
    ax.bar(labels, [r["peak_bytes"] / gb for r in results.values()],
           color=["#4fc3f7" if e == "tinymlx" else "#bdbdbd" for _, _, e in results], label="MLX peak")
    ax.scatter(labels, [(r["weights_bytes"] + r["memory_budget_bytes"]) / gb if "weights_bytes" in r else np.nan
                        for r in results.values()], color="#e57373", marker="_", s=600, label="weights + budget")
    ax.set_ylabel("GB")
    ax.tick_params(axis="x", labelsize=6)
    ax.legend(fontsize=8)
    fig.suptitle(f"Peak memory at a {BUDGET_BYTES / gb:g} GB budget, {setup.info['cpu']}", fontsize=9)
    common.save_results("memory_budget", setup.args.quick, setup.info, {
        "budget_bytes": BUDGET_BYTES, "workload": w,
        "results": [{"model": m, "workload": n, "engine": e, **r} for (m, n, e), r in results.items()],
        "tables": [table]}, fig)


def _has_mlx_lm() -> bool:
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        print("mlx-lm is not installed: tinymlx's rows only", flush=True)
        return False
    return True


def _disk_tier(setup: common.Setup, n: int, directory: Path) -> dict:
    prompt, warm_up = setup.text_ids[:n], setup.text_ids[n:n + 64]
    results = {}
    for mode in ("cold", "write", "disk-warm"):
        print(f"== disk tier: {mode}", flush=True)
        job = {"mode": mode, "model_dir": str(setup.model_dir), "dtype": setup.args.dtype, "prompt": prompt,
               "warm_up": warm_up, "disk_cache_dir": None if mode == "cold" else str(directory / "tier")}
        results[mode] = common.run_in_fresh_process(disk_cache.__file__, job, directory / f"disk-{mode}.json")
    return results


def _agreement(kv: dict) -> tuple[list[int], float]:
    agree, worst = [], 0.0
    for full, int8, full_lp, int8_lp in zip(kv["auto"]["tokens"], kv["int8"]["tokens"], kv["auto"]["logprobs"],
                                            kv["int8"]["logprobs"]):
        n = next((i for i, (a, b) in enumerate(zip(full, int8)) if a != b), len(full))
        agree.append(n)
        worst = max([worst, *(abs(a - b) for a, b in zip(full_lp[:n], int8_lp[:n]))])
    return agree, worst


def _report(setup, model, gguf_bytes, weights, kv, burst, disk) -> None:
    gb = 1e9
    weight_rows = []
    for (engine, dtype), r in weights.items():
        ratio = r["weights_bytes"] / gguf_bytes if gguf_bytes else None
        weight_rows.append([engine, dtype, r["weights_bytes"] / gb, ratio, r["load_s"], r["decode_tok_s"]])
    weight_table = common.print_table(f"Weights and decode speed ({model}; GGUF file {gguf_bytes / gb:.3f} GB)",
                                      ["engine", "dtype", "weights GB", "x file", "load s", "decode tok/s"], weight_rows)

    agree, worst = _agreement(kv)
    full, int8 = kv["auto"], kv["int8"]
    kv_rows = [["float32 (auto)", full["kv_bytes_per_block"], "-", "-", full["long_context_decode_tok_s"],
                full["burst_gen_tok_s"]],
               ["int8", int8["kv_bytes_per_block"], f"{sum(agree)}/{sum(len(t) for t in full['tokens'])}",
                worst, int8["long_context_decode_tok_s"], int8["burst_gen_tok_s"]]]
    kv_table = common.print_table("int8 K/V against the float32 pool", [
        "KV dtype", "bytes/block", "greedy tokens agreeing", "max |dlogprob|", "decode tok/s (long context)",
        "burst gen tok/s (8)"], kv_rows)

    cold = disk["cold"]["ttft_s"]
    disk_rows = [["cold", cold, 1.0], ["warm in memory", disk["cold"]["memory_warm_ttft_s"],
                                       disk["cold"]["memory_warm_ttft_s"] / cold],
                 ["warm from disk (new process)", disk["disk-warm"]["ttft_s"], disk["disk-warm"]["ttft_s"] / cold]]
    disk_table = common.print_table(f"TTFT of a {setup.workload['disk_prompt_tokens']}-token prompt",
                                    ["run", "TTFT s", "x cold"], disk_rows)

    burst_rows = [[engine, r["peak_rss_bytes"] / gb, r["mlx_peak_bytes"] / gb, r["gen_tok_s"], r["mean_ttft_s"]]
                  for engine, r in burst.items()]
    burst_table = common.print_table(f"A {setup.workload['burst']}-request burst", [
        "engine", "peak RSS GB", "MLX peak GB", "gen tok/s", "mean TTFT s"], burst_rows)

    native = weights["tinymlx", "native"]["weights_bytes"] / gguf_bytes if gguf_bytes else None
    bars = {"native_weights_x_file": native, "native_meets_bar": native is not None and native <= NATIVE_BAR,
            "disk_warm_x_cold": disk_rows[2][2], "disk_meets_bar": disk_rows[2][2] <= DISK_BAR,
            "peak_rss_x_mlx_lm": burst["tinymlx"]["peak_rss_bytes"] / burst["mlx-lm"]["peak_rss_bytes"]}
    bars["rss_meets_bar"] = bars["peak_rss_x_mlx_lm"] <= RSS_BAR
    print("\nbars:", bars)

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    ax = axes[0]
    labels = [f"{e}\n{d}" for e, d in weights]
    ax.bar(labels, [r["weights_bytes"] / gb for r in weights.values()],
           color=["#4fc3f7" if e == "tinymlx" else "#bdbdbd" for e, _ in weights])
    if gguf_bytes:
        ax.axhline(gguf_bytes / gb, color="#e57373", linestyle="--", label="GGUF file")
        ax.legend(fontsize=8)
    ax.set_ylabel("weights GB")
    ax.tick_params(axis="x", labelsize=6)
    ax.set_title("Weights per dtype", fontsize=9)
    ax = axes[1]
    ax.bar(labels, [r["decode_tok_s"] for r in weights.values()],
           color=["#4fc3f7" if e == "tinymlx" else "#bdbdbd" for e, _ in weights])
    ax.set_ylabel("decode tok/s (1 stream)")
    ax.tick_params(axis="x", labelsize=6)
    ax.set_title("Decode speed per dtype", fontsize=9)
    ax = axes[2]
    ax.barh([r[0] for r in disk_rows][::-1], [r[1] for r in disk_rows][::-1], color="#81c784")
    for y, row in enumerate(disk_rows[::-1]):
        ax.text(row[1], y, f" {row[1]:.2f} s ({row[2]:.2f}x)", va="center", fontsize=8)
    ax.set_xlim(0, cold * 1.5)
    ax.set_xlabel("TTFT s")
    ax.set_title("Prefix cache tiers", fontsize=9)
    ax = axes[3]
    ax.bar(list(burst), [r["peak_rss_bytes"] / gb for r in burst.values()], color=["#4fc3f7", "#bdbdbd"])
    ax.set_ylabel("peak RSS GB")
    ax.set_title(f"{setup.workload['burst']}-request burst ({bars['peak_rss_x_mlx_lm']:.2f}x mlx-lm)", fontsize=9)
    fig.suptitle(f"{model}, {setup.info['cpu']}", fontsize=9)
    common.save_results("memory", setup.args.quick, setup.info, {
        "model": model, "gguf_bytes": gguf_bytes, "workload": setup.workload,
        "weights": {f"{e} {d}": r for (e, d), r in weights.items()}, "kv": kv, "kv_agreement": agree,
        "burst": burst, "disk": disk, "bars": bars,
        "tables": [weight_table, kv_table, disk_table, burst_table]}, fig)


if __name__ == "__main__":
    main()
