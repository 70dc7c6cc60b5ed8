"""tinymlx vs mlx-lm on each offline model family, same weights; and Gemma 3's KV bytes at long contexts.

For Gemma 3 270M (gemma3), Qwen2.5-Coder 0.5B and 1.5B (qwen2), both engines load the directory
tinymlx converted the offline GGUF to (mlx-lm reads it as a Hugging Face checkpoint), and for gpt-oss a
random checkpoint of its shapes with its experts in MXFP4 (gpt_oss_shaped.py; `--models gpt-oss-shaped`
alone writes results/families_gpt_oss.*), and for Gemma 4 a random checkpoint of E2B's structure (per-layer
inputs, KV-shared layers, sliding and global layers of their own widths: gemma4_shaped.py;
`--models gemma4-e2b-shaped` alone writes results/families_gemma4.*), in the same dtype, and get the same token-id prompts (real
text), greedy, EOS ignored:
- single stream: one request; decode tok/s after its first token (mlx-lm: `stream_generate`);
- a burst: 16 requests arriving at once; aggregate generated tok/s and mean TTFT (mlx-lm: its
  BatchGenerator, what `batch_generate` drives).
Each (model, engine) runs in a fresh process, engines alternating, so memory peaks are per run.

Gemma 3 and Gemma 4: one request whose context reaches 4k, then 32k tokens; when its first token is out,
the KV bytes its blocks hold (every group's blocks in use x that group's bytes per block, from `stats()`),
against full attention in every layer (every layer x context, each at its own width) and the ideal: global
layers x context + sliding layers x window, KV-shared layers counted as nothing (bars: Gemma 3 within 1.3x,
Gemma 4 within 1.1x).
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import common
import gemma4_shaped
import gpt_oss_shaped
import mlx.core as mx
import numpy as np
from matplotlib import pyplot as plt

# mlx-lm's two timed loops, shared with the side-by-side benchmark (same prompts in, same timings out).
from vs_mlx_lm import _batch_generate, _stream_generate

from tinymlx import SamplingParams
from tinymlx.loader import resolve_model_dir
from tinymlx.models import resolve_dtype
from tinymlx.text.tokenizer import Tokenizer

GPT_OSS = "gpt-oss-shaped"  # a random checkpoint of gpt-oss's shapes, MXFP4 experts (gpt_oss_shaped.py)
GEMMA4 = "gemma4-e2b-shaped"  # a random checkpoint of Gemma 4 E2B's structure (gemma4_shaped.py)
MODELS = ("gemma-3-270m", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", GPT_OSS, GEMMA4)
GEMMA = "gemma-3-270m"
KV_BARS = {GEMMA: 1.3, GEMMA4: 1.1}  # the models whose KV one long context holds is measured, and their bars
CHECKPOINTS = {GPT_OSS: gpt_oss_shaped.ensure_checkpoint, GEMMA4: gemma4_shaped.ensure_checkpoint}
WORKLOADS = {
    "full": {"single": {"prompt_len": 128, "output_len": 128}, "burst": 16, "prompt_len": (32, 256),
             "output_len": 64, "contexts": [4096, 32768]},
    "quick": {"single": {"prompt_len": 32, "output_len": 8}, "burst": 4, "prompt_len": (16, 48),
              "output_len": 8, "contexts": [640, 1100]},
}
TINYMLX, MLX_LM = "tinymlx", "mlx-lm"


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--worker", help="internal: a job file to run in this process")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    args, _ = parser.parse_known_args()
    if common.run_worker(args, _run_job):
        return
    args = parser.parse_args()
    common.check_blas()
    info = common.machine_info(args.dtype)
    workload = WORKLOADS["quick" if args.quick else "full"]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, name in enumerate(args.models):
            model_dir = CHECKPOINTS[name](resolve_model_dir(None)) if name in CHECKPOINTS \
                else resolve_model_dir(name)
            text = common.text_token_ids(Tokenizer.from_dir(model_dir))
            rng = np.random.default_rng([args.seed, k])
            single = workload["single"]
            job = {"model_dir": str(model_dir), "dtype": args.dtype,
                   "single": common.sample_prompts(text, 1, (single["prompt_len"],) * 2, rng),
                   "single_tokens": single["output_len"],
                   "burst": common.sample_prompts(text, workload["burst"], workload["prompt_len"], rng),
                   "burst_tokens": workload["output_len"]}
            engines = (TINYMLX, MLX_LM) if k % 2 == 0 else (MLX_LM, TINYMLX)  # alternate who runs first
            results[name] = {}
            for engine in engines:
                print(f"\n== {name}: {engine}", file=sys.stderr)
                engine_job = {**job, "engine": engine}
                if engine == TINYMLX and name in KV_BARS:
                    engine_job["contexts"] = [_context_prompt(text, n) for n in workload["contexts"]]
                results[name][engine] = common.run_in_fresh_process(__file__, engine_job,
                                                                    Path(tmp) / f"{k}-{engine}.json")
    table = _table(results)
    kv = {name: _kv_table(name, results[name][TINYMLX].get("contexts", [])) for name in results if name in KV_BARS}
    bars = _bars(results)
    print("\n" + "\n".join(f"{k}: {v['measured']:.2f} (bar {v['bar']})" for k, v in bars.items()))
    payload = {"workload": {**workload, "seed": args.seed, "models": args.models}, "results": results,
               "bars": bars, "table": table, "kv_table": kv}
    alone = {GPT_OSS: "families_gpt_oss", GEMMA4: "families_gemma4"}  # alone: beside the others' results
    name = alone.get(args.models[0], "families") if len(args.models) == 1 else "families"
    common.save_results(name, args.quick, info, payload, _plot(results))


def _context_prompt(text: list[int], context: int) -> list[int]:
    """A prompt that, with the 2 tokens generated after it, fills `context` tokens (the text repeated)."""
    n = context - 2
    return (text * math.ceil(n / len(text)))[:n]


# -- one engine in one process ------------------------------------------------------------------
def _run_job(job: dict) -> dict:
    return (_run_tinymlx if job["engine"] == TINYMLX else _run_mlx_lm)(job)


def _measured(run: common.Run) -> dict:
    return {**common.summarize(run), "peak_memory_gb": mx.get_peak_memory() / 1e9}


def _run_tinymlx(job: dict) -> dict:
    loaded = common.load_tinymlx(job["model_dir"], job["dtype"])
    common.warm_up(loaded)
    out = {}
    for key in ("single", "burst"):
        mx.clear_cache()
        mx.reset_peak_memory()
        engine = common.new_engine(loaded)
        prompts = job[key]
        params = [common.fixed_length(job[f"{key}_tokens"])] * len(prompts)
        out[key] = _measured(common.run_tinymlx(engine, prompts, params, desc=f"tinymlx {key}"))
        del engine
    out["contexts"] = [_kv_held(loaded, prompt) for prompt in job.get("contexts", [])]
    return out


def _kv_held(loaded: common.LoadedModel, prompt: list[int]) -> dict:
    """The KV bytes one context holds once its prompt is in: read from stats() at its first token."""
    context = len(prompt) + 2
    engine = common.new_engine(loaded, max_num_seqs=1, max_model_len=context,
                               max_num_batched_tokens=2048, enable_prefix_caching=False)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while not any(out.delta_token_ids for out in engine.step()):
        pass
    stats = engine.stats()  # the request is still running: its blocks are held
    groups = []
    page_bytes = stats.kv_cache_bytes_budget / stats.num_pages_total  # a page: one block of the shared pool
    for g in stats.kv_groups:
        held_bytes = g.num_blocks_used * g.cost * page_bytes
        groups.append({"window": g.window, "num_layers": g.num_layers, "num_blocks_used": g.num_blocks_used,
                       "held_bytes": held_bytes,
                       "bytes_per_layer_token": g.cost * page_bytes / (g.num_layers * stats.block_size)})
        groups[-1]["num_shared_layers"] = g.num_shared_layers  # KV-shared layers reading this group's blocks
    padded = math.ceil(context / stats.block_size) * stats.block_size
    # Full attention in every layer: each layer (shared ones too) at its own group's width, every token.
    full = sum((g["num_layers"] + g["num_shared_layers"]) * padded * g["bytes_per_layer_token"] for g in groups)
    ideal = sum(g["num_layers"] * min(context, g["window"] or context) * g["bytes_per_layer_token"] for g in groups)
    result = {
        "context": context,
        "held_bytes": sum(g["held_bytes"] for g in groups),
        "full_attention_bytes": full,
        "ideal_bytes": ideal,  # global layers x context + sliding layers x window (shared: 0), token-exact
        "kv_cache_bytes": stats.kv_cache_bytes,  # the whole pool, allocated up front
        "groups": groups,
    }
    del engine
    mx.clear_cache()
    return result


def _run_mlx_lm(job: dict) -> dict:
    # mlx-lm is imported only in its own workers: it pulls in transformers, which tinymlx never loads.
    import mlx_lm

    model, tokenizer = mlx_lm.load(job["model_dir"])
    dtype = resolve_dtype(job["dtype"])
    if dtype != "float32":  # the converted checkpoint is float32; match tinymlx's dtype
        model.set_dtype(getattr(mx, dtype))
    _batch_generate(model, [job["burst"][0][:8]], 4)  # warm-up
    out = {}
    for key, run in (("single", _stream_generate), ("burst", _batch_generate)):
        mx.clear_cache()
        mx.reset_peak_memory()
        out[key] = _measured(run(model, job[key], job[f"{key}_tokens"], tokenizer=tokenizer))
    return out


# -- report -------------------------------------------------------------------------------------
def _table(results: dict[str, dict]) -> dict:
    headers = ["model", "engine", "decode tok/s (1 stream)", "burst gen tok/s", "burst mean TTFT s",
               "burst peak GB", "x decode", "x burst tok/s", "x burst TTFT"]
    rows = []
    for name, engines in results.items():
        ours = engines[TINYMLX]
        for engine, r in engines.items():
            ratios = [None] * 3
            if engine != TINYMLX:
                ratios = [_ratio(ours["single"]["decode_tok_s_per_stream"], r["single"]["decode_tok_s_per_stream"]),
                          ours["burst"]["gen_tok_s"] / r["burst"]["gen_tok_s"],
                          ours["burst"]["mean_ttft_s"] / r["burst"]["mean_ttft_s"]]
            rows.append([name, engine, r["single"]["decode_tok_s_per_stream"], r["burst"]["gen_tok_s"],
                         r["burst"]["mean_ttft_s"], r["burst"]["peak_memory_gb"], *ratios])
    title = "tinymlx vs mlx-lm, same weights (x = tinymlx / mlx-lm; TTFT: lower is better)"
    return common.print_table(title, headers, rows)


def _kv_table(name: str, contexts: list[dict]) -> dict | None:
    if not contexts:
        return None
    headers = ["context", "held MB", "full attention MB", "held / full", "ideal MB", "held / ideal",
               "pool MB"]
    rows = [[c["context"], c["held_bytes"] / 1e6, c["full_attention_bytes"] / 1e6,
             c["held_bytes"] / c["full_attention_bytes"], c["ideal_bytes"] / 1e6,
             c["held_bytes"] / c["ideal_bytes"], c["kv_cache_bytes"] / 1e6] for c in contexts]
    return common.print_table(f"{name}: KV bytes one context holds (ideal: global layers x context + "
                              "sliding layers x window, KV-shared layers 0)", headers, rows)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _bars(results: dict[str, dict]) -> dict:
    bars = {f"{name}: burst gen tok/s, tinymlx/mlx-lm": {
        "measured": r[TINYMLX]["burst"]["gen_tok_s"] / r[MLX_LM]["burst"]["gen_tok_s"], "bar": ">= 1.2"}
        for name, r in results.items()}
    for name, bar in KV_BARS.items():
        for c in results.get(name, {}).get(TINYMLX, {}).get("contexts", []):
            bars[f"{name}: KV held at {c['context']} tokens / ideal"] = {
                "measured": c["held_bytes"] / c["ideal_bytes"], "bar": f"<= {bar}"}
    return bars


def _plot(results: dict[str, dict]) -> plt.Figure:
    kv_model = next((name for name in KV_BARS if name in results), None)
    contexts = results[kv_model][TINYMLX].get("contexts", []) if kv_model else []
    fig, axes = plt.subplots(1, 4 if contexts else 3, figsize=(20 if contexts else 15, 4.5))
    names = list(results)
    x = np.arange(len(names))
    metrics = (("single", "decode_tok_s_per_stream", "single-stream decode tok/s"),
               ("burst", "gen_tok_s", "burst: generated tok/s"), ("burst", "mean_ttft_s", "burst: mean TTFT (s)"))
    for ax, (key, metric, label) in zip(axes, metrics):
        for offset, engine in ((-0.2, TINYMLX), (0.2, MLX_LM)):
            ax.bar(x + offset, [results[n][engine][key][metric] or 0 for n in names], 0.4, label=engine)
        ax.set_xticks(x, [n.replace("-instruct", "") for n in names], rotation=15)
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    if contexts:
        ax = axes[3]
        labels = [f"{c['context'] // 1024}k" if c["context"] >= 4096 else str(c["context"]) for c in contexts]
        cx = np.arange(len(contexts))
        for offset, key, label in ((-0.27, "held_bytes", "tinymlx holds"), (0, "ideal_bytes", "global x ctx + sliding x W"),
                                   (0.27, "full_attention_bytes", "full attention, every layer")):
            ax.bar(cx + offset, [c[key] / 1e6 for c in contexts], 0.27, label=label)
        ax.set_xticks(cx, labels)
        ax.set_title(f"{kv_model}: KV MB one context holds")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    return fig


if __name__ == "__main__":
    main()
