"""tinymlx vs mlx-vlm on image prompts: Qwen2.5-VL-3B's layer shapes, random weights, one checkpoint for both.

The model: Qwen/Qwen2.5-VL-3B-Instruct's config.json (transformers 4.x layout: the text model's keys at the
top, `vision_config` beside them) with every width as released - text: hidden 2048, 16 query and 2 KV
heads, FFN 11008, the real 151,936-token vocabulary, tied embeddings, M-RoPE sections [16, 24, 24]; vision:
hidden 1280, 16 heads, FFN 3420, output 2048, 14-pixel patches merged 2 x 2, 112-pixel windows - but a
quarter of its depth: 9 text layers of 36 and 8 vision blocks of 32 (full attention in the last, as every
8th block of the released tower). The whole 3B does not fit this benchmark's time on the 2-core CPU: 4x the
depth is about 4x the work, ~48 minutes for a run that takes 11-12 at a quarter (and the machine ran 2x
slower while other workers' tests shared it). A quarter of each keeps every matmul's shape and the tower's
share of the work as in the 3B (the JSON records the released depths and this reason). Weights are random
normal (std 0.02, biases too; norms at one), float32, written once to CHECKPOINT_DIR as the released
checkpoint names them (`model.*`, `visual.*`), with the tokenizer of `--model` (tinymlx's offline Qwen2.5, which has the vision
tokens), Qwen2.5-VL's chat template and preprocessor config: mlx-vlm loads it with its own qwen2_5_vl model
and transformers' AutoProcessor, tinymlx with models/qwen2_5_vl.py. The first conversation turn's greedy
tokens must be identical in both engines (the script asserts it), and so must every burst prompt's token ids.

Workload: 8 requests, each one distinct Pillow-drawn PNG (448x448 and 896x672 alternating: 256 and 768
image tokens) and a short question, greedy, a fixed number of output tokens (EOS ignored), float32.
- burst: all 8 at once. tinymlx as it is; mlx-vlm's `batch_generate` (it groups same-shaped images, runs the
  tower once per group and each group's BatchGenerator to the end before the next group), timed per
  request by wrapping BatchGenerator.next; and mlx-vlm's server loop (each image embedded on its own, every
  request inserted into one BatchGenerator). Throughput = output (or prompt + output) tokens / makespan.
- conversation: turn 1 (an 896x672 image and a question, cold) then turn 2 (turn 1, its answer and a new
  question, the same image). tinymlx: one engine with its prefix cache and encoder cache (and the disk tier
  writing); mlx-vlm: `stream_generate` with a PromptCacheState and a VisionFeatureCache, as `mlx_vlm.chat`
  keeps a conversation.
- disk tier: a new tinymlx process on the directory the conversation wrote sends turn 1 again: its TTFT
  against turn 1's (cold, in the process that wrote the tier).
- memory: the encoder cache's bytes against its budget (`stats().images`) after the burst, and each engine's
  peak (`mx.get_peak_memory`) in the burst.
tinymlx runs twice, each in a fresh process: the portable path (TINYMLX_PORTABLE=1, what a Mac runs) and the
CPU path; mlx-vlm runs between them, so both tinymlx paths see the machine's drift around it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import common
import mlx.core as mx
import numpy as np
from matplotlib import pyplot as plt
from PIL import Image, ImageDraw
from tqdm import tqdm

from tinymlx.loader import resolve_model_dir
from tinymlx.models import resolve_dtype

RELEASED = {"num_hidden_layers": 36, "vision_depth": 32, "fullatt_block_indexes": [7, 15, 23, 31]}
TEXT_LAYERS, VISION_DEPTH = 9, 8
DEPTH_REASON = ("Qwen2.5-VL-3B in float32 does not fit the run's time on the 2-core CPU. Its 36 text layers and 32 "
                "vision blocks are 4x this checkpoint's depth and so about 4x its work, and the run at this depth took "
                "12 min with the machine quiet: ~48 min at the full depth, ~24 at half, and this machine ran 2x slower "
                "while other workers' tests shared it. A quarter of the depth of each keeps every matmul's shape and "
                "the tower's share of the work, and the run within ~25 min.")
CONFIG = {  # Qwen/Qwen2.5-VL-3B-Instruct's config.json, at a quarter of its depth
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008,
    "max_position_embeddings": 128000, "max_window_layers": 70, "num_attention_heads": 16,
    "num_hidden_layers": TEXT_LAYERS, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "float32", "use_cache": True,
    "use_sliding_window": False, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
    "vision_config": {"depth": VISION_DEPTH, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [VISION_DEPTH - 1], "tokens_per_second": 2, "temporal_patch_size": 2},
}
PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor"}
CHAT_TEMPLATE = (  # Qwen2.5-VL's
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
CHECKPOINT_DIR = Path(f"~/.cache/tinymlx-bench/qwen2.5-vl-3b-{TEXT_LAYERS}l-{VISION_DEPTH}v-random").expanduser()
LAYERS_PER_SHARD = 3
SIZES = ((448, 448), (896, 672))  # width x height: 256 and 768 image tokens
QUESTIONS = ["What is in this picture?", "Describe the shapes you see.", "Which colours dominate this image?",
             "Read the text in the image.", "How many objects are there?", "Where is the green circle?",
             "Is this a photo or a drawing?", "Summarise this image in one sentence."]
FOLLOW_UP = "And what is in the top left corner?"
WORKLOADS = {
    "full": {"sizes": [SIZES[i % 2] for i in range(8)], "output_len": 32, "conversation_size": SIZES[1],
             "continuous": True},
    "quick": {"sizes": [SIZES[0]] * 2, "output_len": 8, "conversation_size": SIZES[0], "continuous": True},
}
PORTABLE, CPU, MLX_VLM = "tinymlx portable", "tinymlx CPU", "mlx-vlm"
GROUPED, CONTINUOUS = "mlx-vlm batch_generate", "mlx-vlm one BatchGenerator"
TINYMLX_PATHS = {PORTABLE: "1", CPU: "0"}  # TINYMLX_PORTABLE in the worker's environment


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--worker", help="internal: a job file to run in this process")
    args, _ = parser.parse_known_args()
    if common.run_worker(args, _run_job):
        return
    args = parser.parse_args()
    common.check_blas()
    info = {**common.machine_info(args.dtype), "mlx_vlm": _version("mlx-vlm"), "transformers": _version("transformers")}
    workload = WORKLOADS["quick" if args.quick else "full"]
    checkpoint = ensure_checkpoint(resolve_model_dir(args.model))
    gemm = _gemm_gflops(resolve_dtype(args.dtype))
    t_start = time.perf_counter()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = [_write_image(tmp / f"image-{i}.png", size, i) for i, size in enumerate(workload["sizes"])]
        job = {"model_dir": str(checkpoint), "dtype": args.dtype, "images": paths,
               "questions": QUESTIONS[:len(paths)], "max_tokens": workload["output_len"],
               "conversation_image": _write_image(tmp / "conversation.png", workload["conversation_size"], 99),
               "warm_up_image": _write_image(tmp / "warm-up.png", (56, 56), 98), "continuous": workload["continuous"]}
        for name in (PORTABLE, MLX_VLM, CPU):
            print(f"\n== {name}", file=sys.stderr)
            results[name] = _fresh(name, {**job, "engine": name, "disk_cache_dir": str(tmp / f"disk-{name[8:]}")},
                                   tmp / f"{name.replace(' ', '-')}.json")
        for name in TINYMLX_PATHS:
            print(f"\n== {name}: a new process on the disk tier", file=sys.stderr)
            results[name]["disk_resumed"] = _fresh(
                name, {**job, "engine": name, "mode": "resumed", "disk_cache_dir": str(tmp / f"disk-{name[8:]}")},
                tmp / f"{name.replace(' ', '-')}-resumed.json")
    results = {name: results[name] for name in (PORTABLE, CPU, MLX_VLM)}  # reported portable first, CPU beside it
    fairness = _check_fairness(results)
    for burst in _bursts(results).values():
        del burst["prompt_token_ids"]  # checked equal above; thousands of ids per engine
    tables = {"burst": _burst_table(results), "conversation": _conversation_table(results),
              "disk": _disk_table(results), "memory": _memory_table(results)}
    floor = _prefill_floor(workload["sizes"], results[PORTABLE]["burst"]["num_prompt_tokens"], gemm)
    print(f"\nthe burst's prefill is {floor['tflop']:.1f} TFLOP of matmuls (tower {floor['tower_tflop']:.1f}, text "
          f"{floor['text_tflop']:.1f}): {floor['seconds']:.0f} s at this machine's {gemm:.0f} GFLOP/s "
          "(one [4096, 2048] x [2048, 11008] matmul, measured before the run)")
    bars = _bars(results)
    for k, v in bars.items():
        print(f"{k}: {v['measured']:.3f} (bar {v['bar']}: {'met' if v['met'] else 'MISSED'})")
    run_s = time.perf_counter() - t_start
    print(f"\nrun time {run_s / 60:.1f} min (checkpoint written before)")
    payload = {"workload": {**workload, "seed": args.seed, "questions": job["questions"], "follow_up": FOLLOW_UP},
               "checkpoint": str(checkpoint), "config": CONFIG, "released_depths": RELEASED,
               "depth_reason": DEPTH_REASON, "tokenizer_from": str(resolve_model_dir(args.model)),
               "run_s": run_s, "prefill_floor": floor, "fairness": fairness, "results": results, "bars": bars, "tables": tables}
    common.save_results("vision", args.quick, info, payload, _plot(results))


def _fresh(name: str, job: dict, path: Path) -> dict:
    env = None
    if name in TINYMLX_PATHS:
        env = {**os.environ, "TINYMLX_PORTABLE": TINYMLX_PATHS[name]}
    return common.run_in_fresh_process(__file__, job, path, env=env)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _gemm_gflops(dtype: str) -> float:
    """This machine's matmul rate on the text MLP's shape at a 4096-row prefill, best of 3."""
    x, w = mx.random.normal((4096, 2048)).astype(getattr(mx, dtype)), mx.random.normal((2048, 11008)).astype(getattr(mx, dtype))
    mx.eval(x @ w)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        mx.eval(x @ w)
        best = min(best, time.perf_counter() - t0)
    return 2 * 4096 * 2048 * 11008 / best / 1e9


def _prefill_floor(sizes: list[tuple[int, int]], num_prompt_tokens: int, gflops: float) -> dict:
    """The burst's prefill matmul FLOPs (the tower's linears and attention, the text layers' linears; the text's
    attention and head left out, a few percent), and the seconds they take at `gflops`."""
    v, c = CONFIG["vision_config"], CONFIG
    vis, patch, unit = v["hidden_size"], v["patch_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    block = 2 * (4 * vis * vis + 3 * vis * v["intermediate_size"])  # qkv, proj, gate, up, down: per patch
    window = (v["window_size"] // patch) ** 2
    tower = 0
    for width, height in sizes:
        n = (width // patch) * (height // patch)
        full = len(v["fullatt_block_indexes"])
        attention = 4 * vis * (window * (VISION_DEPTH - full) + n * full)  # QK^T and PV, per patch
        merger = 2 * (unit * unit + unit * v["out_hidden_size"]) // v["spatial_merge_size"] ** 2
        tower += n * (2 * 3 * 2 * patch * patch * vis + VISION_DEPTH * block + attention + merger)
    hidden, kv = c["hidden_size"], c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    text = num_prompt_tokens * TEXT_LAYERS * 2 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * c["intermediate_size"])
    return {"tower_tflop": tower / 1e12, "text_tflop": text / 1e12, "tflop": (tower + text) / 1e12,
            "gemm_gflops": gflops, "seconds": (tower + text) / gflops / 1e9}


# -- the checkpoint and the images ---------------------------------------------------------------
def _tensors(layer: int | str) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape: a text layer's (an int), a vision block's ("v<i>") or those outside them."""
    c, v = CONFIG, CONFIG["vision_config"]
    hidden, vis = c["hidden_size"], v["hidden_size"]
    if layer == "outside":
        return {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if layer == "vision":
        unit = vis * v["spatial_merge_size"] ** 2
        return {"visual.patch_embed.proj.weight": (vis, 3, v["temporal_patch_size"], v["patch_size"], v["patch_size"]),
                "visual.merger.ln_q.weight": (vis,), "visual.merger.mlp.0.weight": (unit, unit),
                "visual.merger.mlp.0.bias": (unit,), "visual.merger.mlp.2.weight": (v["out_hidden_size"], unit),
                "visual.merger.mlp.2.bias": (v["out_hidden_size"],)}
    if isinstance(layer, str):  # a vision block
        p, inter = f"visual.blocks.{layer[1:]}.", v["intermediate_size"]
        return {p + "norm1.weight": (vis,), p + "norm2.weight": (vis,),
                p + "attn.qkv.weight": (3 * vis, vis), p + "attn.qkv.bias": (3 * vis,),
                p + "attn.proj.weight": (vis, vis), p + "attn.proj.bias": (vis,),
                **{p + f"mlp.{n}_proj.weight": (inter, vis) for n in ("gate", "up")},
                **{p + f"mlp.{n}_proj.bias": (inter,) for n in ("gate", "up")},
                p + "mlp.down_proj.weight": (vis, inter), p + "mlp.down_proj.bias": (vis,)}
    p, inter = f"model.layers.{layer}.", c["intermediate_size"]
    kv = c["num_key_value_heads"] * hidden // c["num_attention_heads"]
    return {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            **{p + f"mlp.{n}_proj.weight": (inter, hidden) for n in ("gate", "up")},
            p + "mlp.down_proj.weight": (hidden, inter)}


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if "norm" in name or name.endswith("ln_q.weight"):  # Qwen's RMSNorms scale by w: one is the identity
        return np.ones(shape, dtype=np.float32)
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= 0.02
    return x


def ensure_checkpoint(tokenizer_dir: Path, path: Path = CHECKPOINT_DIR) -> Path:
    """The random checkpoint, written on first use; the chat template and the processor's settings are
    (re)written beside it on every run (small files, so a checkpoint written before them still loads)."""
    rng = np.random.default_rng(0)
    layers = list(range(TEXT_LAYERS))
    groups = ([["outside"], ["vision"] + [f"v{i}" for i in range(VISION_DEPTH)]]
              + [layers[i:i + LAYERS_PER_SHARD] for i in range(0, TEXT_LAYERS, LAYERS_PER_SHARD)])
    shards = [lambda group=group: {name: _init(name, shape, rng)
                                   for layer in group for name, shape in _tensors(layer).items()}
              for group in groups]
    common.write_random_checkpoint(path, "Qwen2.5-VL-3B-shaped (quarter depth)", tokenizer_dir, CONFIG, shards)
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": CHAT_TEMPLATE}))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return path


def _write_image(path: Path, size: tuple[int, int], seed: int) -> str:
    """A distinct picture: a gradient with noise, shapes and text (every patch differs), as a PNG."""
    width, height = size
    rng = np.random.default_rng(seed)
    x, y = np.meshgrid(np.linspace(0, 1, width), np.linspace(0, 1, height))
    tint = rng.uniform(0.3, 1.0, 3)
    pixels = np.stack([x * tint[0], y * tint[1], (x + y) / 2 * tint[2]], axis=-1) * 200
    image = Image.fromarray((pixels + rng.uniform(0, 55, (height, width, 3))).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.integers(0, width * 3 // 4), rng.integers(0, height * 3 // 4)
        box = (x0, y0, x0 + rng.integers(width // 10, width // 3), y0 + rng.integers(height // 10, height // 3))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    draw.text((8, 8), f"image {seed}: tinymlx vs mlx-vlm", fill=(255, 255, 255))
    image.save(path, format="PNG")
    return str(path)


def _user(image: str, question: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}


def _follow_up(job: dict, answer: str) -> list[dict]:
    """Turn 2: turn 1, its answer (special-token markup dropped: it would be read as markup) and a new question."""
    answer = re.sub(r"<\|[a-z_]+\|>", "", answer)
    return [_user(job["conversation_image"], job["questions"][0]), {"role": "assistant", "content": answer},
            {"role": "user", "content": FOLLOW_UP}]


# -- tinymlx in one process ----------------------------------------------------------------------
def _run_job(job: dict) -> dict:
    if job["engine"] == MLX_VLM:
        return _run_mlx_vlm(job)
    return _run_tinymlx_resumed(job) if job.get("mode") == "resumed" else _run_tinymlx(job)


def _load_tinymlx(job: dict):
    from tinymlx import Engine, EngineConfig
    from tinymlx.models import load_model
    from tinymlx.models.checkpoint import load_config
    from tinymlx.ops import kernels
    from tinymlx.text.tokenizer import Tokenizer
    from tinymlx.vision.processors import image_processor_for

    model_dir = Path(job["model_dir"])
    t0 = time.perf_counter()
    model = load_model(model_dir, job["dtype"])
    tokenizer, processor = Tokenizer.from_dir(model_dir), image_processor_for(model_dir, load_config(model_dir))
    load_s = time.perf_counter() - t0

    def new_engine(**config):
        return Engine(model, tokenizer, EngineConfig(**config), model_name=model_dir.name, image_processor=processor)

    mx.eval(model.parameters())
    info = {"load_s": load_s, "kernels": os.environ.get(kernels.PORTABLE_ENV, "0"),
            "weights_gb": sum(v.nbytes for _, v in _flat(model.parameters())) / 1e9}
    common.run_tinymlx(new_engine(), [[_user(job["warm_up_image"], "hi")]], [common.fixed_length(4)], desc="warm-up")
    return new_engine, info


def _flat(tree) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def _turn_tinymlx(engine, messages: list[dict], max_tokens: int, desc: str) -> dict:
    before = engine.stats().images
    run = common.run_tinymlx(engine, [messages], [common.fixed_length(max_tokens)], desc=desc)
    (timing,), (output,) = run.requests, run.outputs
    after = engine.stats().images
    return {"ttft_s": timing.ttft_s, "e2e_s": timing.e2e_s, "num_prompt_tokens": timing.num_prompt_tokens,
            "num_cached_tokens": output.metrics.num_cached_tokens, "token_ids": list(output.token_ids),
            "prompt_token_ids": list(output.prompt_token_ids), "text": output.text,
            "num_encoded_images": after.num_encoded_images - before.num_encoded_images,
            "num_encoder_cache_hits": after.num_cache_hits - before.num_cache_hits}


def _run_tinymlx(job: dict) -> dict:
    new_engine, out = _load_tinymlx(job)
    n, max_tokens = len(job["images"]), job["max_tokens"]
    mx.clear_cache()
    mx.reset_peak_memory()
    engine = new_engine()
    run = common.run_tinymlx(engine, [[_user(i, q)] for i, q in zip(job["images"], job["questions"])],
                             [common.fixed_length(max_tokens)] * n, desc=f"tinymlx burst of {n}")
    stats = engine.stats()
    out["burst"] = {**_summary(run), "peak_memory_gb": mx.get_peak_memory() / 1e9,
                    "kv_pool_gb": stats.kv_cache_bytes / 1e9, "kv_budget_gb": stats.kv_cache_bytes_budget / 1e9,
                    "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps,
                    "images": dataclasses.asdict(stats.images),
                    "token_ids": [list(o.token_ids) for o in run.outputs],
                    "prompt_token_ids": [list(o.prompt_token_ids) for o in run.outputs]}
    del engine
    mx.clear_cache()
    engine = new_engine(disk_cache_dir=job["disk_cache_dir"])  # the conversation writes the disk tier as it goes
    first = _turn_tinymlx(engine, [_user(job["conversation_image"], job["questions"][0])], max_tokens, "turn 1")
    second = _turn_tinymlx(engine, _follow_up(job, first["text"]), max_tokens, "turn 2")
    engine.disk_tier.flush()
    out["conversation"] = {"turn1": first, "turn2": second, "ttft_ratio": second["ttft_s"] / first["ttft_s"],
                           "images": dataclasses.asdict(engine.stats().images),
                           "disk_files": engine.stats().disk_cache.num_files}
    engine.close()
    return out


def _run_tinymlx_resumed(job: dict) -> dict:
    """Turn 1 again in a new process, on the disk tier the conversation wrote."""
    new_engine, out = _load_tinymlx(job)
    engine = new_engine(disk_cache_dir=job["disk_cache_dir"])
    turn = _turn_tinymlx(engine, [_user(job["conversation_image"], job["questions"][0])], job["max_tokens"],
                         "turn 1 from disk")
    disk = engine.stats().disk_cache
    engine.close()
    return {**out, **turn, "disk_hits": disk.num_hits, "disk_bytes_read": disk.num_bytes_read}


def _summary(run: common.Run) -> dict:
    s = common.summarize(run)
    return {**s, "total_tok_s": (s["num_prompt_tokens"] + s["num_output_tokens"]) / s["makespan_s"],
            "ttft_s": [r.ttft_s for r in run.requests]}


# -- mlx-vlm in one process ----------------------------------------------------------------------
def _run_mlx_vlm(job: dict) -> dict:
    # mlx-vlm is imported only in its own worker: it pulls in transformers, which tinymlx never loads.
    import mlx_vlm

    t0 = time.perf_counter()
    model, processor = mlx_vlm.load(job["model_dir"])
    out: dict = {"load_s": time.perf_counter() - t0}
    dtype = resolve_dtype(job["dtype"])
    if dtype != "float32":  # the checkpoint is float32; match tinymlx's dtype
        model.set_dtype(getattr(mx, dtype))
    criteria = processor.tokenizer.stopping_criteria  # EOS ignored: every request runs to max_tokens
    criteria.eos_token_ids, criteria.additional_eos_token_ids = [], []
    _stream_mlx_vlm(model, processor, [_user(job["warm_up_image"], "hi")], 4)  # warm-up
    n, max_tokens = len(job["images"]), job["max_tokens"]
    runs = [(GROUPED, _grouped_mlx_vlm)] + ([(CONTINUOUS, _continuous_mlx_vlm)] if job["continuous"] else [])
    for name, run in runs:
        mx.clear_cache()
        mx.reset_peak_memory()
        result, tokens, prompts = run(model, processor, job["images"], job["questions"], max_tokens)
        if any(len(t) != max_tokens for t in tokens):
            raise RuntimeError(f"{name}: {[len(t) for t in tokens]} tokens, expected {max_tokens} each")
        out[name] = {**_summary(result), "peak_memory_gb": mx.get_peak_memory() / 1e9, "token_ids": tokens,
                     "prompt_token_ids": prompts, "num_requests": n}
    mx.clear_cache()
    from mlx_vlm import PromptCacheState, VisionFeatureCache

    state, vision_cache = PromptCacheState(), VisionFeatureCache()
    first = _stream_mlx_vlm(model, processor, [_user(job["conversation_image"], job["questions"][0])], max_tokens,
                            prompt_cache_state=state, vision_cache=vision_cache)
    second = _stream_mlx_vlm(model, processor, _follow_up(job, first["text"]), max_tokens,
                             prompt_cache_state=state, vision_cache=vision_cache)
    out["conversation"] = {"turn1": first, "turn2": second, "ttft_ratio": second["ttft_s"] / first["ttft_s"],
                           "vision_cache_entries": len(vision_cache),
                           "model_has_encode_images": hasattr(model, "encode_images")}
    return out


def _prompt_mlx_vlm(processor, messages: list[dict]) -> tuple[str, list[str]]:
    """The chat template's text with one {"type": "image"} part per image, and the image paths in order."""
    images, rendered = [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            images += [p["image"] for p in content if p["type"] == "image"]
            content = [{"type": "image"} if p["type"] == "image" else p for p in content]
        rendered.append({**m, "content": content})
    return processor.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True), images


def _stream_mlx_vlm(model, processor, messages: list[dict], max_tokens: int, **cache) -> dict:
    """One request through `stream_generate` (with `cache`: mlx_vlm.chat's PromptCacheState and
    VisionFeatureCache), timed."""
    from mlx_vlm import stream_generate

    prompt, images = _prompt_mlx_vlm(processor, messages)
    text, first, last = "", None, None
    t0 = time.perf_counter()
    for result in stream_generate(model, processor, prompt, image=images, max_tokens=max_tokens, **cache):
        first = first or time.perf_counter() - t0
        text += result.text
        last = result  # the last one repeats the last token, with every token's id
    e2e = time.perf_counter() - t0
    tokens = list(last.token_ids)
    if len(tokens) != max_tokens:
        raise RuntimeError(f"stream_generate gave {len(tokens)} tokens, expected {max_tokens}")
    return {"ttft_s": first, "e2e_s": e2e, "num_prompt_tokens": last.prompt_tokens,
            "num_cached_tokens": getattr(last, "cached_tokens", 0), "token_ids": tokens, "text": text}


def _grouped_mlx_vlm(model, processor, images: list[str], questions: list[str], max_tokens: int):
    """`batch_generate` as it is, with BatchGenerator.insert and .next wrapped to time each request: it
    makes one BatchGenerator per image shape, in the order group_images_by_shape gives."""
    from mlx_vlm import batch_generate
    from mlx_vlm.generate import ar
    from mlx_vlm.utils import group_images_by_shape, load_image

    _, groups = group_images_by_shape([load_image(p) for p in images])
    order = [i for indices in groups.values() for i in indices]  # generator k's uid u is request order[...]
    events, prompts, generators = [], {}, []
    insert, step = ar.BatchGenerator.insert, ar.BatchGenerator.next

    def timed_insert(self, batch, *a, **kw):
        uids = insert(self, batch, *a, **kw)
        generators.append(self)
        base = sum(len(g._bench_uids) for g in generators[:-1])
        self._bench_uids = {uid: order[base + k] for k, uid in enumerate(uids)}
        for uid, p, *_ in self._unprocessed_sequences:  # the prompts as queued, padding removed
            prompts[self._bench_uids[uid]] = [int(t) for t in p]
        return uids

    def timed_next(self, **kw):
        prompt_responses, responses = step(self, **kw)
        now = time.perf_counter() - t0
        events.extend((self._bench_uids[r.uid], now, int(r.token)) for r in responses)
        bar.update(len(responses))
        return prompt_responses, responses

    ar.BatchGenerator.insert, ar.BatchGenerator.next = timed_insert, timed_next
    try:
        with tqdm(total=max_tokens * len(images), desc=f"batch_generate x{len(images)}", leave=False) as bar:
            t0 = time.perf_counter()
            batch_generate(model, processor, images=images, prompts=questions, max_tokens=max_tokens)
            makespan = time.perf_counter() - t0
    finally:
        ar.BatchGenerator.insert, ar.BatchGenerator.next = insert, step
    return _timed_run(events, prompts, len(images), makespan)


def _continuous_mlx_vlm(model, processor, images: list[str], questions: list[str], max_tokens: int):
    """mlx-vlm's server loop for requests that arrive together (server/generation.py, ResponseGenerator): each
    request's image run through the tower on its own (get_input_embeddings), every request inserted into one
    BatchGenerator (its default prefill and completion batch sizes), then next() until all are done."""
    from mlx_vlm.generate import BatchGenerator
    from mlx_vlm.utils import prepare_inputs

    events, prompts, uids = [], {}, {}
    with tqdm(total=max_tokens * len(images), desc=f"one BatchGenerator x{len(images)}", leave=False) as bar:
        t0 = time.perf_counter()
        generator = BatchGenerator(model.language_model, processor, compute_logprobs=False)
        for i, (image, question) in enumerate(zip(images, questions)):
            prompt, _ = _prompt_mlx_vlm(processor, [_user(image, question)])
            inputs = prepare_inputs(processor, images=[image], prompts=[prompt],
                                    image_token_index=getattr(model.config, "image_token_index", None))
            ids, pixels, mask = inputs["input_ids"], inputs["pixel_values"], inputs.get("attention_mask")
            data = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
            embeds = model.get_input_embeddings(ids, pixels, mask=mask, **data)
            kwargs = {**data, **{k: v for k, v in embeds.to_dict().items() if v is not None}}
            prompts[i] = ids.squeeze(0).tolist()
            (uid,) = generator.insert([prompts[i]], max_tokens, prompt_kwargs=[kwargs])
            uids[uid] = i
        while generator.has_work:
            _, responses = generator.next()
            now = time.perf_counter() - t0
            events.extend((uids[r.uid], now, int(r.token)) for r in responses)
            bar.update(len(responses))
        makespan = time.perf_counter() - t0
        generator.close()
    return _timed_run(events, prompts, len(images), makespan)


def _timed_run(events: list, prompts: dict, n: int, makespan: float):
    tokens: list[list[int]] = [[] for _ in range(n)]
    first, last = {}, {}
    for i, now, token in events:
        tokens[i].append(token)
        first.setdefault(i, now)
        last[i] = now
    timings = [common.RequestTiming(len(prompts[i]), len(tokens[i]), first[i], last[i]) for i in range(n)]
    return common.Run(timings, makespan), tokens, [prompts[i] for i in range(n)]


# -- report --------------------------------------------------------------------------------------
def _check_fairness(results: dict) -> dict:
    """The same prompt tokens in every engine, and the same greedy tokens on turn 1 (asserted)."""
    ours = results[PORTABLE]
    turn1 = {name: r["conversation"]["turn1"]["token_ids"] for name, r in results.items()}
    if len({tuple(t) for t in turn1.values()}) != 1:
        raise AssertionError(f"turn 1's greedy tokens differ between engines: {turn1}")
    mlx_vlm = results[MLX_VLM]
    bursts = {name: r["burst"] for name, r in results.items() if name in TINYMLX_PATHS}
    bursts.update({name: mlx_vlm[name] for name in (GROUPED, CONTINUOUS) if name in mlx_vlm})
    for name, burst in bursts.items():
        if burst["prompt_token_ids"] != ours["burst"]["prompt_token_ids"]:
            raise AssertionError(f"{name}'s burst prompts are not tinymlx's token ids")
    same = {name: sum(a == b for a, b in zip(burst["token_ids"], ours["burst"]["token_ids"]))
            for name, burst in bursts.items()}
    print(f"\nturn 1: identical greedy tokens in every engine ({len(turn1[PORTABLE])} tokens); burst requests "
          "whose tokens equal tinymlx portable's: " + ", ".join(f"{k} {v}/{len(ours['burst']['token_ids'])}"
                                                               for k, v in same.items()))
    return {"turn1_identical": True, "turn1_tokens": turn1[PORTABLE], "burst_prompts_identical": True,
            "burst_requests_identical_to_portable": same,
            "turn2_prompt_tokens": {n: r["conversation"]["turn2"]["num_prompt_tokens"] for n, r in results.items()}}


def _bursts(results: dict) -> dict[str, dict]:
    rows = {name: results[name]["burst"] for name in TINYMLX_PATHS}
    rows.update({name: results[MLX_VLM][name] for name in (GROUPED, CONTINUOUS) if name in results[MLX_VLM]})
    return rows


def _best_mlx_vlm(results: dict) -> tuple[str, dict]:
    rows = {k: v for k, v in _bursts(results).items() if k.startswith("mlx-vlm")}
    return max(rows.items(), key=lambda kv: kv[1]["gen_tok_s"])


def _burst_table(results: dict) -> dict:
    best_name, best = _best_mlx_vlm(results)
    headers = ["engine", "requests", "prompt tok", "output tok", "makespan s", "output tok/s", "total tok/s",
               "mean TTFT s", "p99 TTFT s", "decode tok/s/stream", "peak GB", "x output tok/s", "x mean TTFT"]
    rows = [[name, r["num_requests"], r["num_prompt_tokens"], r["num_output_tokens"], r["makespan_s"], r["gen_tok_s"],
             r["total_tok_s"], r["mean_ttft_s"], r["p99_ttft_s"], r["decode_tok_s_per_stream"], r["peak_memory_gb"],
             r["gen_tok_s"] / best["gen_tok_s"], r["mean_ttft_s"] / best["mean_ttft_s"]]
            for name, r in _bursts(results).items()]
    return common.print_table(f"A burst of image requests, all at once (x = that row / {best_name}, mlx-vlm's "
                              "best; TTFT: lower is better)", headers, rows)


def _conversation_table(results: dict) -> dict:
    headers = ["engine", "turn 1 prompt tok", "turn 1 TTFT s", "turn 2 prompt tok", "turn 2 cached tok",
               "turn 2 TTFT s", "turn 2 / turn 1", "tower runs in turn 2"]
    rows = []
    for name, r in results.items():
        c = r["conversation"]
        t1, t2 = c["turn1"], c["turn2"]
        runs = t2.get("num_encoded_images", "-")
        rows.append([name, t1["num_prompt_tokens"], t1["ttft_s"], t2["num_prompt_tokens"], t2["num_cached_tokens"],
                     t2["ttft_s"], c["ttft_ratio"], runs])
    return common.print_table("A conversation's second turn with the same image: TTFT against the first", headers, rows)


def _disk_table(results: dict) -> dict:
    headers = ["path", "cold TTFT s (turn 1)", "new process on the tier: TTFT s", "x cold", "cached tok",
               "prompt tok", "tower runs", "disk MB read"]
    rows = []
    for name in TINYMLX_PATHS:
        cold, resumed = results[name]["conversation"]["turn1"], results[name]["disk_resumed"]
        rows.append([name, cold["ttft_s"], resumed["ttft_s"], resumed["ttft_s"] / cold["ttft_s"],
                     resumed["num_cached_tokens"], resumed["num_prompt_tokens"], resumed["num_encoded_images"],
                     resumed["disk_bytes_read"] / 1e6])
    return common.print_table("The same image in a new process, from the disk tier", headers, rows)


def _memory_table(results: dict) -> dict:
    headers = ["engine", "weights GB", "KV pool GB", "KV budget GB", "burst peak GB", "encoder cache MB", "budget MB",
               "images cached", "tower runs", "cache hits"]
    rows = []
    for name, r in _bursts(results).items():
        images = r.get("images")
        weights = results[name]["weights_gb"] if name in TINYMLX_PATHS else None
        rows.append([name, weights, r.get("kv_pool_gb"), r.get("kv_budget_gb"), r["peak_memory_gb"], *([images["cache_bytes"] / 1e6, images["cache_bytes_budget"] / 1e6,
                     images["num_cached_images"], images["num_encoded_images"], images["num_cache_hits"]]
                     if images else [None] * 5)])
    return common.print_table("Memory after the burst (tinymlx's encoder cache from stats().images)", headers, rows)


def _bars(results: dict) -> dict:
    best_name, best = _best_mlx_vlm(results)
    bars = {}
    for name in TINYMLX_PATHS:
        ratio = results[name]["burst"]["gen_tok_s"] / best["gen_tok_s"]
        bars[f"burst output tok/s, {name} / {best_name}"] = {"measured": ratio, "bar": ">= 1.5", "met": ratio >= 1.5}
    for name in TINYMLX_PATHS:
        ratio = results[name]["conversation"]["ttft_ratio"]
        bars[f"turn 2 / turn 1 TTFT, {name}"] = {"measured": ratio, "bar": "<= 0.1", "met": ratio <= 0.1}
    return bars


def _plot(results: dict) -> plt.Figure:
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    bursts = _bursts(results)
    names = [n.replace("mlx-vlm ", "mlx-vlm\n").replace("tinymlx ", "tinymlx\n") for n in bursts]
    colors = ["C0", "C2", "C1", "C3"][:len(bursts)]
    for ax, (key, label) in zip(axes, (("gen_tok_s", "burst: output tok/s"), ("mean_ttft_s", "burst: mean TTFT (s)"))):
        values = [r[key] for r in bursts.values()]
        ax.bar(names, values, color=colors)
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(label)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    ax = axes[2]
    x = np.arange(len(results))
    for offset, key, label in ((-0.2, "turn1", "turn 1 (cold)"), (0.2, "turn2", "turn 2 (same image)")):
        ax.bar(x + offset, [r["conversation"][key]["ttft_s"] for r in results.values()], 0.4, label=label)
    for i, r in enumerate(results.values()):
        ax.annotate(f"{r['conversation']['ttft_ratio']:.3f}x", (i + 0.2, r["conversation"]["turn2"]["ttft_s"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [n.replace(" ", "\n", 1) for n in results], fontsize=8)
    ax.set_title("conversation: TTFT (s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax = axes[3]
    x = np.arange(len(TINYMLX_PATHS))
    cold = [results[n]["conversation"]["turn1"]["ttft_s"] for n in TINYMLX_PATHS]
    resumed = [results[n]["disk_resumed"]["ttft_s"] for n in TINYMLX_PATHS]
    ax.bar(x - 0.2, cold, 0.4, label="cold (turn 1)")
    ax.bar(x + 0.2, resumed, 0.4, label="new process, disk tier")
    for i, (c, r) in enumerate(zip(cold, resumed)):
        ax.annotate(f"{r / c:.3f}x", (i + 0.2, r), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, list(TINYMLX_PATHS), fontsize=8)
    ax.set_title("the same image from disk: TTFT (s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Qwen2.5-VL-3B shapes at a quarter depth ({TEXT_LAYERS} text layers, {VISION_DEPTH} vision "
                 "blocks), random weights, float32")
    return fig


if __name__ == "__main__":
    main()
