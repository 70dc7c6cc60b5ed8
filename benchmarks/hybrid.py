"""tinymlx vs mlx-lm on a hybrid recurrent model: Qwen3.5-0.8B's shapes, random weights, same checkpoint.

The model: Qwen3.5-0.8B's text backbone (Qwen/Qwen3.5-0.8B's config.json, text_config): 24 layers of
width 1024, every 4th gated full attention (8 query heads, 2 KV heads of 256, a quarter of each head
rotated, RoPE base 1e7), the other 18 Gated DeltaNet (16 key and 16 value heads of 128, a 4-wide causal
conv), SwiGLU MLP of 3584, the real 248,320-token vocabulary, tied embeddings. Its weights are random
(normal, std 0.02; norms at their identity: zeros for the 1 + w RMSNorms, ones for the gated norm;
A_log = log U[1, 16], dt_bias = 1), float32, written once to CHECKPOINT_DIR in the released
checkpoint's layout: model_type `qwen3_5` with the text model's config under `text_config` and its
weights under `model.language_model.` (mlx-lm reads no `qwen3_5_text` model_type), no vision tower.
Checked once with transformers 5.x: Qwen3_5ForCausalLM.from_pretrained loads the directory with no
missing, unexpected or mismatched keys (752M parameters), and its argmax on a prompt equals mlx-lm's.
There is no Qwen3.5 tokenizer offline: the checkpoint carries the tokenizer of `--model` (default:
tinymlx's offline Qwen2.5), and both engines get token-id prompts cut from real text, greedy, EOS
ignored. Generated ids past that tokenizer's 151k entries decode to nothing in either engine (HF
tokenizers skips them; mlx-lm's streaming detokenizer prints "!"): the benchmark counts tokens.

Each engine runs in a fresh process, one after the other (an odd --seed swaps them), on the same prompts:
- single stream: one request; decode tok/s after its first token (mlx-lm: `stream_generate`);
- a burst: 16 requests arriving at once; aggregate generated tok/s and mean TTFT (mlx-lm: its
  BatchGenerator, what `batch_generate` drives);
- shared prompt: request A is a 2,000-token system prompt + a ~30-token question, run to its first
  token; then request B, the same system prompt + another question. TTFT(B) / TTFT(A): tinymlx with
  its prefix cache on (the recurrent layers restart from a state checkpoint; the request's
  num_cached_tokens says how deep the hit was); mlx-lm plain (`stream_generate` on each prompt: no
  reuse), and mlx-lm with its server's system-prompt cache: the prompt cache saved where the system
  prompt ends and a copy of it handed to B, as `mlx_lm.server` does for a chat's system message (its
  recurrent state cannot be trimmed back, so only a cache saved exactly there can be reused).
Each process first runs a tiny warm-up request (as families.py does), and before the shared-prompt
part one cold prompt of its length on other text, so that no timed request pays one-off costs.

Then tinymlx alone, an agent's conversation resumed from disk (`--only disk-resume` runs just this part,
its results in results/hybrid_disk_resume.{json,png}): a 4,000-token prompt, the conversation's next turn.
Three fresh processes, one after the other, each on a short warm-up request on other text first:
- write: a disk tier on an empty directory; the turn before (the prompt less its last 30 tokens), cold,
  its blocks and recurrent-state checkpoints saved as it goes, then the time until all are on disk;
- cold: no disk tier; the prompt's TTFT;
- resumed: a new process on that directory; the prompt's TTFT, its blocks and the deepest checkpoint
  (the previous turn's last full block) read, verified and restored: only the tokens after it computed.
The bar: resumed TTFT at most 0.1x cold.

Also, in tinymlx's process: the two forms of the delta rule alone (one GDN layer's heads, random inputs),
token by token against chunk-wise (WY, chunks of 16), for one sequence's prefill chunk of 512 tokens
and a decode step of 16 sequences.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path

import common
import hybrid_parts as parts
import mlx.core as mx
import numpy as np
from matplotlib import pyplot as plt

# mlx-lm's two timed loops, shared with the side-by-side benchmark (same prompts in, same timings out).
from vs_mlx_lm import _batch_generate, _stream_generate

from tinymlx.loader import resolve_model_dir
from tinymlx.models import gated_delta, resolve_dtype
from tinymlx.text.tokenizer import Tokenizer

# Qwen/Qwen3.5-0.8B's text_config (rope_parameters as transformers 5.x writes them).
TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # x 6: see _config
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "dtype": "float32",
}
CHECKPOINT_DIR = Path("~/.cache/tinymlx-bench/qwen3.5-0.8b-random").expanduser()
PREFIX = "model.language_model."
LAYERS_PER_SHARD = 6
WORKLOADS = {
    "full": {"single": {"prompt_len": 128, "output_len": 128},
             "burst": {"num_requests": 16, "prompt_len": (32, 256), "output_len": 64},
             "shared": {"system_len": 2000, "question_len": 30},
             "disk_resume": {"prompt_len": 4000, "new_len": 30}},
    "quick": {"single": {"prompt_len": 32, "output_len": 8},
              "burst": {"num_requests": 4, "prompt_len": (16, 48), "output_len": 8},
              "shared": {"system_len": 256, "question_len": 16},
              "disk_resume": {"prompt_len": 256, "new_len": 30}},
}
TINYMLX, MLX_LM = "tinymlx", "mlx-lm"
ENGINES = (TINYMLX, MLX_LM)
MLX_LM_PLAIN, MLX_LM_CACHED = "mlx-lm stream_generate", "mlx-lm system-prompt cache"
DISK_RESUME = "disk-resume"
DISK_RESUME_MODES = ("write", "cold", "resumed")  # in this order: each a fresh process


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--worker", help="internal: a job file to run in this process")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--only", choices=[DISK_RESUME, parts.SPECULATION, parts.TP],
                        help="run only this part: disk-resume (a prompt resumed from disk in a new process), "
                        "speculation (n-gram and MTP at a forced acceptance rate) or tp (TP=2 vs TP=1)")
    args, _ = parser.parse_known_args()
    if common.run_worker(args, _run_job):
        return
    args = parser.parse_args()
    common.check_blas()
    info = common.machine_info(args.dtype)
    workload = WORKLOADS["quick" if args.quick else "full"]
    tokenizer_dir = resolve_model_dir(args.model)
    checkpoint = ensure_checkpoint(tokenizer_dir)
    text = common.text_token_ids(Tokenizer.from_dir(checkpoint))
    rng = np.random.default_rng(args.seed)
    if args.only in (parts.SPECULATION, parts.TP):
        _run_part(args.only, checkpoint, text, args, info, rng)
        return
    if args.only == DISK_RESUME:
        disk = _disk_resume(checkpoint, text, workload["disk_resume"], args.dtype, rng)
        table, bar = _disk_resume_table(disk), _disk_resume_bar(disk)
        name = bar.pop("name")
        print(f"\n{name}: {bar['measured']:.3f} (bar {bar['bar']})")
        fig, ax = plt.subplots(figsize=(7, 3.2))
        _plot_disk_resume(ax, disk)
        common.save_results("hybrid_disk_resume", args.quick, info,
                            {"workload": {**workload["disk_resume"], "seed": args.seed}, "checkpoint": str(checkpoint),
                             "disk_resume": disk, "bars": {name: bar}, "disk_resume_table": table}, fig)
        return
    single, burst, shared = workload["single"], workload["burst"], workload["shared"]
    system, warm = common.sample_prompts(text, 2, (shared["system_len"] + shared["question_len"],) * 2, rng)
    questions = common.sample_prompts(text, 2, (shared["question_len"],) * 2, rng)
    system = system[:shared["system_len"]]
    job = {"model_dir": str(checkpoint), "dtype": args.dtype,
           "single": common.sample_prompts(text, 1, (single["prompt_len"],) * 2, rng),
           "single_tokens": single["output_len"],
           "burst": common.sample_prompts(text, burst["num_requests"], burst["prompt_len"], rng),
           "burst_tokens": burst["output_len"],
           "shared": [system + q for q in questions], "system_len": len(system),
           "warm_shared": [warm]}  # the shared prompts' shape on other text, run first: no one-off costs timed
    results: dict[str, dict] = {}
    engines = [e for e in ENGINES if e in args.engines]
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines if args.seed % 2 == 0 else engines[::-1]:  # another seed, the other order
            print(f"\n== {engine}", file=sys.stderr)
            results[engine] = common.run_in_fresh_process(__file__, {**job, "engine": engine},
                                                          Path(tmp) / f"{engine}.json")
    disk = _disk_resume(checkpoint, text, workload["disk_resume"], args.dtype, rng) if TINYMLX in engines else None
    table = _table(results)
    shared_table = _shared_table(results, len(system))
    forms_table = _delta_rule_table(results)
    disk_table = _disk_resume_table(disk) if disk else None
    bars = _bars(results)
    if disk:
        bar = _disk_resume_bar(disk)
        bars[bar.pop("name")] = bar
    print("\n" + "\n".join(f"{k}: {v['measured']:.2f} (bar {v['bar']})" for k, v in bars.items()))
    payload = {"workload": {**workload, "seed": args.seed, "engines": engines}, "checkpoint": str(checkpoint),
               "tokenizer_from": str(tokenizer_dir), "text_config": _config()["text_config"],
               "results": results, "bars": bars, "table": table, "shared_table": shared_table,
               "delta_rule_table": forms_table, "disk_resume": disk, "disk_resume_table": disk_table}
    common.save_results("hybrid", args.quick, info, payload, _plot(results, disk))


def _run_part(part: str, checkpoint: Path, text: list[int], args, info: dict, rng: np.random.Generator) -> None:
    """hybrid_parts.py's speculation or tensor-parallel part, in a fresh process, and its results."""
    workload = parts.WORKLOADS["quick" if args.quick else "full"]
    count = max(workload["concurrency"]) if part == parts.SPECULATION else workload["tp_requests"]
    model_dir = parts.ensure_mtp_checkpoint(checkpoint, _tensors(3), _init) if part == parts.SPECULATION else checkpoint
    job = {"engine": part, "dtype": args.dtype, "model_dir": str(model_dir),
           "prompts": common.sample_prompts(text, count, (workload["prompt_len"],) * 2, rng),
           **({"output_len": workload["tp_output_len"]} if part == parts.TP else
              {key: workload[key] for key in ("output_len", "concurrency", "rate", "k")})}
    with tempfile.TemporaryDirectory() as tmp:
        result = common.run_in_fresh_process(__file__, job, Path(tmp) / f"{part}.json")
    if part == parts.SPECULATION:
        table, bar = parts.speculation_table(result), parts.speculation_bar(result, workload["rate"], workload["k"])
        bars = {bar.pop("name"): bar}
        fig = parts.figure(parts.plot_speculation, result)
    else:
        table = parts.tp_table(result)
        bars = {"TP=2 gives identical tokens": {"measured": result["identical_tokens"], "bar": True}}
        fig = parts.figure(parts.plot_tp, result)
    print("\n" + "\n".join(f"{k}: {v['measured']} (bar {v['bar']})" for k, v in bars.items()))
    common.save_results(f"hybrid_{part}", args.quick, info, {"workload": {**workload, "seed": args.seed},
                        "checkpoint": str(model_dir), "results": result, "bars": bars, "table": table}, fig)


# -- the checkpoint ------------------------------------------------------------------------------
def _config() -> dict:
    text = {**TEXT_CONFIG, "layer_types": TEXT_CONFIG["layer_types"] * (TEXT_CONFIG["num_hidden_layers"] // 4)}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": True, "text_config": text, "dtype": "float32",
            "bos_token_id": None, "eos_token_id": 151645}  # the carried tokenizer's <|im_end|>


def _tensors(layer: int | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, init) of one layer's tensors, or (layer None) those outside the layers."""
    c = TEXT_CONFIG
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    if layer is None:
        return {"embed_tokens.weight": ((c["vocab_size"], hidden), "normal"), "norm.weight": ((hidden,), "zeros")}
    p = f"layers.{layer}."
    out = {p + "input_layernorm.weight": ((hidden,), "zeros"),
           p + "post_attention_layernorm.weight": ((hidden,), "zeros"),
           p + "mlp.gate_proj.weight": ((inter, hidden), "normal"),
           p + "mlp.up_proj.weight": ((inter, hidden), "normal"),
           p + "mlp.down_proj.weight": ((hidden, inter), "normal")}
    if (layer + 1) % c["full_attention_interval"] == 0:  # gated full attention: q_proj holds query + gate
        heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        a = p + "self_attn."
        out.update({a + "q_proj.weight": ((2 * heads * d, hidden), "normal"),
                    a + "k_proj.weight": ((kv * d, hidden), "normal"),
                    a + "v_proj.weight": ((kv * d, hidden), "normal"),
                    a + "o_proj.weight": ((hidden, heads * d), "normal"),
                    a + "q_norm.weight": ((d,), "zeros"), a + "k_norm.weight": ((d,), "zeros")})
    else:  # Gated DeltaNet
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        conv = 2 * hk * dk + hv * dv
        g = p + "linear_attn."
        out.update({g + "in_proj_qkv.weight": ((conv, hidden), "normal"),
                    g + "in_proj_z.weight": ((hv * dv, hidden), "normal"),
                    g + "in_proj_b.weight": ((hv, hidden), "normal"),
                    g + "in_proj_a.weight": ((hv, hidden), "normal"),
                    g + "conv1d.weight": ((conv, 1, c["linear_conv_kernel_dim"]), "normal"),
                    g + "out_proj.weight": ((hidden, hv * dv), "normal"),
                    g + "A_log": ((hv,), "a_log"), g + "dt_bias": ((hv,), "ones"),
                    g + "norm.weight": ((dv,), "ones")})
    return out


def _init(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "normal":
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= 0.02
        return x
    if kind == "a_log":
        return np.log(rng.uniform(1, 16, shape)).astype(np.float32)
    return (np.zeros if kind == "zeros" else np.ones)(shape, dtype=np.float32)


def ensure_checkpoint(tokenizer_dir: Path, path: Path = CHECKPOINT_DIR) -> Path:
    """The random checkpoint, written on first use: shards of LAYERS_PER_SHARD layers."""
    rng = np.random.default_rng(0)
    layers = TEXT_CONFIG["num_hidden_layers"]
    groups = [[None]] + [list(range(i, min(i + LAYERS_PER_SHARD, layers))) for i in range(0, layers, LAYERS_PER_SHARD)]
    shards = [lambda group=group: {PREFIX + key: _init(shape, kind, rng)
                                   for layer in group for key, (shape, kind) in _tensors(layer).items()}
              for group in groups]
    return common.write_random_checkpoint(path, "Qwen3.5-0.8B-shaped", tokenizer_dir, _config(), shards)


# -- one engine in one process ------------------------------------------------------------------
def _run_job(job: dict) -> dict:
    return {TINYMLX: _run_tinymlx, MLX_LM: _run_mlx_lm, DISK_RESUME: _run_disk_resume,
            parts.SPECULATION: parts.run_speculation, parts.TP: parts.run_tp}[job["engine"]](job)


def _measured(run: common.Run) -> dict:
    return {**common.summarize(run), "peak_memory_gb": mx.get_peak_memory() / 1e9}


def _run_tinymlx(job: dict) -> dict:
    t0 = time.perf_counter()
    loaded = common.load_tinymlx(job["model_dir"], job["dtype"])
    out: dict = {"load_s": time.perf_counter() - t0}
    common.warm_up(loaded)
    for key in ("single", "burst"):
        mx.clear_cache()
        mx.reset_peak_memory()
        engine = common.new_engine(loaded)
        params = [common.fixed_length(job[f"{key}_tokens"])] * len(job[key])
        out[key] = _measured(common.run_tinymlx(engine, job[key], params, desc=f"tinymlx {key}"))
        del engine
    common.run_tinymlx(common.new_engine(loaded), job["warm_shared"], [common.fixed_length(1)], desc="warm-up")
    engine = common.new_engine(loaded)  # prefix caching on (the default): A's blocks and states serve B
    a, b = (_first_token_tinymlx(engine, prompt) for prompt in job["shared"])
    out["shared"] = {TINYMLX: {"a": a, "b": b, "ttft_ratio": b["ttft_s"] / a["ttft_s"]}}
    out["delta_rule"] = _delta_rule_forms()
    return out


def _delta_rule_forms(repeats: int = 3) -> list[dict]:
    """ms per call of each form of the delta rule, for one GDN layer of the model (16 heads of 128)."""
    c, rng, rows = TEXT_CONFIG, np.random.default_rng(0), []
    H, D = c["linear_num_value_heads"], c["linear_key_head_dim"]
    for B, L in ((1, 512), (1, 64), (16, 1)):
        q, k = (mx.array(rng.standard_normal((B, L, H, D), dtype=np.float32)) for _ in range(2))
        q, k = q * mx.rsqrt((q * q).sum(-1, keepdims=True)) * D**-0.5, k * mx.rsqrt((k * k).sum(-1, keepdims=True))
        v = mx.array(rng.standard_normal((B, L, H, D), dtype=np.float32))
        g, beta = mx.array(-rng.uniform(0, 2, (B, L, H)).astype(np.float32)), mx.array(rng.uniform(0, 1, (B, L, H)).astype(np.float32))
        inputs = (q, k, v, g, beta, mx.zeros((B, H, D, D)))
        row = {"batch": B, "tokens": L}
        forms = {"token by token": lambda *x: gated_delta.recurrent(*x)[:2]}
        if L > 1:
            forms["chunk-wise (16)"] = lambda *x: gated_delta.chunked(*x, chunk_size=16)[:2]
        for name, form in forms.items():
            mx.eval(form(*inputs))
            t0 = time.perf_counter()
            for _ in range(repeats):
                mx.eval(form(*inputs))
            row[name] = (time.perf_counter() - t0) / repeats * 1000
        rows.append(row)
    return rows


def _first_token_tinymlx(engine, prompt: list[int]) -> dict:
    before = engine.num_computed_prompt_tokens
    run = common.run_tinymlx(engine, [prompt], [common.fixed_length(1)], desc="tinymlx shared prompt")
    (timing,), (output,) = run.requests, run.outputs
    return {"ttft_s": timing.ttft_s, "num_prompt_tokens": len(prompt),
            "num_cached_tokens": output.metrics.num_cached_tokens,
            "num_computed_prompt_tokens": engine.num_computed_prompt_tokens - before}


# -- an agent's conversation resumed from disk in a new process (tinymlx) ----------------------------
def _disk_resume(checkpoint: Path, text: list[int], workload: dict, dtype: str, rng: np.random.Generator) -> dict:
    """The three processes of the disk-resume part, one after the other, on one temporary directory."""
    prompt, warm = common.sample_prompts(text, 2, (workload["prompt_len"],) * 2, rng)
    job = {"engine": DISK_RESUME, "model_dir": str(checkpoint), "dtype": dtype, "prompt": prompt,
           "history": prompt[:-workload["new_len"]], "warm_up": warm[:64]}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in DISK_RESUME_MODES:
            print(f"\n== tinymlx {DISK_RESUME}: {mode}", file=sys.stderr)
            directory = None if mode == "cold" else str(Path(tmp) / "tier")
            results[mode] = common.run_in_fresh_process(__file__, {**job, "mode": mode, "disk_cache_dir": directory},
                                                        Path(tmp) / f"{DISK_RESUME}-{mode}.json")
    results["ttft_ratio"] = results["resumed"]["ttft_s"] / results["cold"]["ttft_s"]
    return results


def _run_disk_resume(job: dict) -> dict:
    loaded = common.load_tinymlx(job["model_dir"], job["dtype"])
    common.warm_up(loaded)
    engine = common.new_engine(loaded, disk_cache_dir=job["disk_cache_dir"])
    common.ttft(engine, job["warm_up"])  # through the disk tier too: its first save and read are not timed
    before = engine.stats().disk_cache
    out = _first_token_tinymlx(engine, job["history"] if job["mode"] == "write" else job["prompt"])
    if engine.disk_tier is not None:
        t0 = time.perf_counter()
        engine.disk_tier.flush()
        disk = engine.stats().disk_cache
        out.update(flush_s=time.perf_counter() - t0, num_files=disk.num_files,
                   num_block_hits=disk.num_hits - before.num_hits,
                   num_checkpoint_hits=disk.num_checkpoint_hits - before.num_checkpoint_hits,
                   bytes_read=disk.num_bytes_read - before.num_bytes_read,
                   bytes_written=disk.num_bytes_written - before.num_bytes_written,
                   writes_dropped=disk.num_writes_dropped, bad_files=disk.num_bad_files)
    engine.close()
    return out


def _disk_resume_table(disk: dict) -> dict:
    cold = disk["cold"]["ttft_s"]
    names = {"write": "the turn before, cold, writing the disk tier", "cold": "the prompt, cold (no disk tier)",
             "resumed": "the prompt resumed from disk (new process)"}
    rows = [[names[mode], disk[mode]["num_prompt_tokens"], disk[mode]["ttft_s"], disk[mode]["ttft_s"] / cold,
             disk[mode]["num_cached_tokens"], disk[mode]["num_computed_prompt_tokens"],
             disk[mode].get("bytes_written" if mode == "write" else "bytes_read", 0) / 1e6]
            for mode in DISK_RESUME_MODES]
    headers = ["run", "prompt tokens", "TTFT s", "x cold", "cached tokens", "computed", "disk MB written/read"]
    return common.print_table("A hybrid prompt resumed from disk in a new process: TTFT against cold", headers, rows)


def _disk_resume_bar(disk: dict) -> dict:
    return {"name": f"{disk['cold']['num_prompt_tokens']}-token hybrid prompt resumed from disk in a new process, "
                    "TTFT / cold", "measured": disk["ttft_ratio"], "bar": "<= 0.1"}


def _plot_disk_resume(ax, disk: dict) -> None:
    labels = {"write": "turn before, cold\n(writing the tier)", "cold": "cold", "resumed": "resumed from disk\n(new process)"}
    times = [disk[mode]["ttft_s"] for mode in DISK_RESUME_MODES]
    ax.barh([labels[m] for m in DISK_RESUME_MODES][::-1], times[::-1], color="#4fc3f7")
    for y, t in enumerate(times[::-1]):
        ax.text(t, y, f" {t:.2f} s ({t / disk['cold']['ttft_s']:.2f}x)", va="center", fontsize=8)
    ax.set_xlim(0, max(times) * 1.4)
    ax.set_xlabel("TTFT (s)")
    ax.set_title(f"{disk['cold']['num_prompt_tokens']}-token prompt resumed from disk", fontsize=9)


def _run_mlx_lm(job: dict) -> dict:
    # mlx-lm is imported only in its own workers: it pulls in transformers, which tinymlx never loads.
    import mlx_lm

    t0 = time.perf_counter()
    model, tokenizer = mlx_lm.load(job["model_dir"])
    out: dict = {"load_s": time.perf_counter() - t0}
    dtype = resolve_dtype(job["dtype"])
    if dtype != "float32":  # the checkpoint is float32; match tinymlx's dtype
        model.set_dtype(getattr(mx, dtype))
    _batch_generate(model, [job["burst"][0][:8]], 4)  # warm-up
    for key, run in (("single", _stream_generate), ("burst", _batch_generate)):
        mx.clear_cache()
        mx.reset_peak_memory()
        out[key] = _measured(run(model, job[key], job[f"{key}_tokens"], tokenizer=tokenizer))
    out["shared"] = _shared_mlx_lm(model, tokenizer, job)
    return out


def _shared_mlx_lm(model, tokenizer, job: dict) -> dict:
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    tokenizer.eos_token_ids = set()
    n = job["system_len"]
    _first_token_mlx_lm(model, tokenizer, job["warm_shared"][0])
    plain = [_first_token_mlx_lm(model, tokenizer, prompt) for prompt in job["shared"]]
    # The server's way: prefill the system prompt, save a copy of the cache there, go on with A;
    # B starts from a copy of the saved one (LRUPromptCache.fetch_nearest_cache deep-copies it).
    prompt_a, prompt_b = job["shared"]
    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    _prefill(model, cache, prompt_a[:n])
    saved = copy.deepcopy(cache)
    cached_a = time.perf_counter() - t0 + _first_token_mlx_lm(model, tokenizer, prompt_a[n:], cache)["ttft_s"]
    t0 = time.perf_counter()
    cache = copy.deepcopy(saved)
    cached_b = time.perf_counter() - t0 + _first_token_mlx_lm(model, tokenizer, prompt_b[n:], cache)["ttft_s"]
    can_trim = can_trim_prompt_cache(make_prompt_cache(model))
    rows = {MLX_LM_PLAIN: (plain[0]["ttft_s"], plain[1]["ttft_s"], 0), MLX_LM_CACHED: (cached_a, cached_b, n)}
    return {name: {"a": {"ttft_s": a, "num_prompt_tokens": len(prompt_a), "num_cached_tokens": 0},
                   "b": {"ttft_s": b, "num_prompt_tokens": len(prompt_b), "num_cached_tokens": hit},
                   "ttft_ratio": b / a, "can_trim_prompt_cache": can_trim}
            for name, (a, b, hit) in rows.items()}


def _prefill(model, cache: list, tokens: list[int], step: int = 2048) -> None:
    """generate_step's prefill (its default prefill_step_size): the tokens into the cache, no logits kept."""
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i:i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def _first_token_mlx_lm(model, tokenizer, prompt: list[int], cache: list | None = None) -> dict:
    from mlx_lm import stream_generate

    t0 = time.perf_counter()
    for _ in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=1, prompt_cache=cache):
        break
    return {"ttft_s": time.perf_counter() - t0}


# -- report -------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _table(results: dict[str, dict]) -> dict:
    headers = ["engine", "decode tok/s (1 stream)", "burst gen tok/s", "burst mean TTFT s", "burst peak GB",
               "x decode", "x burst tok/s", "x burst TTFT"]
    ours = results.get(TINYMLX)
    rows = []
    for engine, r in results.items():
        ratios = [None] * 3
        if engine != TINYMLX and ours is not None:
            ratios = [_ratio(ours["single"]["decode_tok_s_per_stream"], r["single"]["decode_tok_s_per_stream"]),
                      ours["burst"]["gen_tok_s"] / r["burst"]["gen_tok_s"],
                      ours["burst"]["mean_ttft_s"] / r["burst"]["mean_ttft_s"]]
        rows.append([engine, r["single"]["decode_tok_s_per_stream"], r["burst"]["gen_tok_s"],
                     r["burst"]["mean_ttft_s"], r["burst"]["peak_memory_gb"], *ratios])
    title = "Qwen3.5-0.8B shapes, random weights: tinymlx vs mlx-lm (x = tinymlx / mlx-lm; TTFT: lower is better)"
    return common.print_table(title, headers, rows)


def _shared_rows(results: dict[str, dict]) -> dict[str, dict]:
    return {name: row for r in results.values() for name, row in r["shared"].items()}


def _shared_table(results: dict[str, dict], system_len: int) -> dict:
    headers = ["engine", "TTFT A s", "TTFT B s", "B / A", "B cached tokens", "B prefill computed"]
    rows = [[name, r["a"]["ttft_s"], r["b"]["ttft_s"], r["ttft_ratio"], r["b"]["num_cached_tokens"],
             r["b"].get("num_computed_prompt_tokens", r["b"]["num_prompt_tokens"] - r["b"]["num_cached_tokens"])]
            for name, r in _shared_rows(results).items()]
    title = f"Shared system prompt ({system_len} tokens): A cold, then B with the same system prompt"
    return common.print_table(title, headers, rows)


def _delta_rule_table(results: dict[str, dict]) -> dict | None:
    if TINYMLX not in results:
        return None
    rows = [[f"{r['batch']} x {r['tokens']}", r["token by token"], r.get("chunk-wise (16)"),
             _ratio(r["token by token"], r.get("chunk-wise (16)"))] for r in results[TINYMLX]["delta_rule"]]
    return common.print_table("One GDN layer's delta rule (16 heads of 128), ms per call",
                              ["sequences x tokens", "token by token ms", "chunk-wise ms", "speed-up"], rows)


def _bars(results: dict[str, dict]) -> dict:
    bars = {}
    if TINYMLX in results and MLX_LM in results:
        bars["burst gen tok/s, tinymlx / mlx-lm BatchGenerator"] = {
            "measured": results[TINYMLX]["burst"]["gen_tok_s"] / results[MLX_LM]["burst"]["gen_tok_s"],
            "bar": ">= 1.5"}
    if TINYMLX in results:
        bars["shared-prompt TTFT(B) / TTFT(A), tinymlx"] = {
            "measured": results[TINYMLX]["shared"][TINYMLX]["ttft_ratio"], "bar": "<= 0.25"}
    return bars


def _plot(results: dict[str, dict], disk: dict | None) -> plt.Figure:
    fig, axes = plt.subplots(1, 5 if disk else 4, figsize=(25 if disk else 20, 4.5))
    engines = list(results)
    metrics = (("single", "decode_tok_s_per_stream", "single-stream decode tok/s"),
               ("burst", "gen_tok_s", "burst: generated tok/s"), ("burst", "mean_ttft_s", "burst: mean TTFT (s)"))
    for ax, (key, metric, label) in zip(axes, metrics):
        ax.bar(engines, [results[e][key][metric] or 0 for e in engines], color=["C0", "C1"][:len(engines)])
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
    ax = axes[3]
    shared = _shared_rows(results)
    x = np.arange(len(shared))
    for offset, key, label in ((-0.2, "a", "A (cold)"), (0.2, "b", "B (same system prompt)")):
        ax.bar(x + offset, [r[key]["ttft_s"] for r in shared.values()], 0.4, label=label)
    for i, r in enumerate(shared.values()):
        ax.annotate(f"B/A {r['ttft_ratio']:.2f}", (i, max(r["a"]["ttft_s"], r["b"]["ttft_s"])),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [n.replace("mlx-lm ", "mlx-lm\n") for n in shared], fontsize=8)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
    ax.set_title("shared system prompt: TTFT (s)")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3, axis="y")
    if disk:
        _plot_disk_resume(axes[4], disk)
    fig.suptitle("Qwen3.5-0.8B shapes (Gated DeltaNet + gated attention), random weights")
    return fig


if __name__ == "__main__":
    main()
