"""Single-stream decode: tinymlx's synchronous step and its overlapped step (Engine.run_ahead), each on the
portable kernels (what a Mac runs, here on the CPU) and on the CPU's, and mlx-lm's stream_generate, rounds
alternated in one process so all see the machine's load drift alike; and the machine's bandwidth bound for
the model.

One request of `--prompt` tokens of real text, `--tokens` greedy tokens with EOS ignored. Decode tok/s is
(tokens - 1) / (e2e - TTFT) per round (median over `--rounds`, after a warm-up round of each); the time
between consecutive tokens over every round gives the step time's median and 10th percentile, which a
noisy machine moves less. The bound: the bytes of weights a token reads (every parameter; an untied
embedding table only by the row it looks up) over the GB/s of the fastest one-row matmul measured here
(numpy's gemv over a 1 GiB float32 matrix, best of 5).

    python benchmarks/single_stream.py [--tokens 64] [--rounds 6] [--prompt 64]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import common
import mlx.core as mx
import numpy as np
from matplotlib import pyplot as plt
from mlx.utils import tree_flatten

from tinymlx import SamplingParams
from tinymlx.ops.cpu.linear import LINEAR_LAYOUT_ENV


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=64)
    args = parser.parse_args()
    common.check_blas()
    import mlx_lm  # only here: it pulls in transformers, which tinymlx never loads

    loaded_portable = common.load_tinymlx_for(args.model, args.dtype, portable=True)  # linears stay nn.Linear
    loaded = common.load_tinymlx_for(args.model, args.dtype, portable=False)
    common.warm_up(loaded)
    model, tokenizer = mlx_lm.load(str(loaded.model_dir))
    tokenizer.eos_token_ids = set()  # run to max_tokens, as ignore_eos does
    prompt = common.text_token_ids(loaded.tokenizer)[1000:1000 + args.prompt]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    runs = {"portable, synchronous": lambda: _portable(loaded_portable, prompt, params, False),
            "portable, overlapped": lambda: _portable(loaded_portable, prompt, params, True),
            "CPU, synchronous": lambda: _tinymlx(loaded, prompt, params, False),
            "CPU, overlapped": lambda: _tinymlx(loaded, prompt, params, True),
            "mlx-lm": lambda: _mlx_lm(model, tokenizer, prompt, args.tokens)}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    gaps: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[int]] = {}
    for round_ in range(args.rounds + 1):
        for name, run in runs.items():
            stamps, tokens[name] = run()
            rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
            gaps[name] += np.diff(stamps).tolist()
            if round_:
                rates[name].append(rate)
            print(f"round {round_} {name}: {rate:.3f} tok/s", file=sys.stderr, flush=True)
    same = {name: t == tokens["mlx-lm"] for name, t in tokens.items()}
    print(f"the same tokens as mlx-lm: {same}")
    gb_per_token = _weight_bytes_per_token(loaded.model) / 1e9
    gb_per_s = _gemv_gb_per_s()
    bound = gb_per_s / gb_per_token
    print(f"bandwidth bound: {gb_per_token:.3f} GB per token at {gb_per_s:.1f} GB/s = {bound:.2f} tok/s")
    reference = statistics.median(rates["mlx-lm"])
    rows = []
    for name, values in rates.items():
        median, ms = statistics.median(values), np.array(gaps[name]) * 1e3
        rows.append([name, median, median / reference, median / bound, float(np.median(ms)),
                     float(np.percentile(ms, 10)), " ".join(f"{v:.2f}" for v in values)])
    table = common.print_table(f"single-stream decode, {args.tokens} tokens, {args.rounds} rounds alternated",
                               ["", "decode tok/s", "x mlx-lm", "x bound", "step ms", "p10 ms", "rounds"], rows)
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([row[0] for row in rows], [row[1] for row in rows], color=["#8172b2", "#64b5cd", "#4c72b0", "#55a868", "#c44e52"])
    ax.axvline(bound, color="black", linestyle="--", linewidth=0.8, label=f"bandwidth bound {bound:.1f}")
    ax.set_xlabel("decode tok/s (median)")
    ax.legend(fontsize=8)
    layout = os.environ.get(LINEAR_LAYOUT_ENV) or "measured per shape"
    ax.set_title(f"single stream, float32 weights' layout: {layout}", fontsize=9)
    common.save_results("single_stream", False, {**common.machine_info(args.dtype), "linear_layout": layout},
                        {"table": table, "same_tokens_as_mlx_lm": same, "rates": rates,
                         "bound": {"gb_per_token": gb_per_token, "gb_per_s": gb_per_s, "tok_s": bound}}, fig)


def _tinymlx(loaded: common.LoadedModel, prompt: list[int], params: SamplingParams,
             overlapped: bool) -> tuple[list[float], list[int]]:
    engine = common.new_engine(loaded)
    engine.run_ahead.is_enabled = overlapped
    engine.add_request(prompt, params)
    stamps, token_ids = [], []
    while engine.has_unfinished_requests:
        for out in engine.step():
            stamps += [time.perf_counter()] * bool(out.delta_token_ids)
            token_ids = out.token_ids
    return stamps, token_ids


def _portable(loaded: common.LoadedModel, prompt: list[int], params: SamplingParams,
              overlapped: bool) -> tuple[list[float], list[int]]:
    with common.portable_kernels():
        return _tinymlx(loaded, prompt, params, overlapped)


def _mlx_lm(model, tokenizer, prompt: list[int], max_tokens: int) -> tuple[list[float], list[int]]:
    from mlx_lm import stream_generate

    stamps, token_ids = [], []
    for response in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens):
        stamps.append(time.perf_counter())
        token_ids.append(response.token)
    return stamps, token_ids


def _weight_bytes_per_token(model) -> int:
    """Every parameter's bytes, but an untied embedding table's: a lookup reads one row of it."""
    embedding = model.model.embed_tokens
    table = 0 if model.args.tie_word_embeddings else sum(a.nbytes for _, a in tree_flatten(embedding.parameters()))
    return sum(a.nbytes for _, a in tree_flatten(model.parameters())) - table


def _gemv_gb_per_s(repeats: int = 5) -> float:
    matrix = np.random.default_rng(0).standard_normal((1 << 18, 1024), dtype=np.float32)  # 1 GiB
    row = np.ones(1024, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        matrix @ row
        best = min(best, time.perf_counter() - started)
    return matrix.nbytes / best / 1e9


if __name__ == "__main__":
    main()
