"""Single-stream decode of the synchronous step, the overlapped step (Engine.run_ahead) and mlx-lm's
stream_generate, rounds alternated in one process so all three see the machine's load drift alike.

One request of `--prompt` tokens of real text, `--tokens` greedy tokens with EOS ignored. Decode tok/s is
(tokens - 1) / (e2e - TTFT) per round (median over `--rounds`, after a warm-up round of each); the time
between consecutive tokens over every round gives the step time's median and 10th percentile, which a
noisy machine moves less.

    python benchmarks/overlap.py [--tokens 64] [--rounds 6] [--prompt 64]
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

    loaded = common.load_tinymlx(args.model, args.dtype)
    common.warm_up(loaded)
    model, tokenizer = mlx_lm.load(str(loaded.model_dir))
    tokenizer.eos_token_ids = set()  # run to max_tokens, as ignore_eos does
    prompt = common.text_token_ids(loaded.tokenizer)[1000:1000 + args.prompt]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    runs = {"synchronous": lambda: _tinymlx(loaded, prompt, params, False),
            "overlapped": lambda: _tinymlx(loaded, prompt, params, True),
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
    same = all(t == tokens["synchronous"] for t in tokens.values())
    print(f"same tokens: {same}")
    reference = statistics.median(rates["mlx-lm"])
    rows = []
    for name, values in rates.items():
        median, ms = statistics.median(values), np.array(gaps[name]) * 1e3
        rows.append([name, median, median / reference, float(np.median(ms)), float(np.percentile(ms, 10)),
                     " ".join(f"{v:.2f}" for v in values)])
    table = common.print_table(f"single-stream decode, {args.tokens} tokens, {args.rounds} rounds alternated",
                               ["", "decode tok/s", "x mlx-lm", "step ms", "p10 ms", "rounds"], rows)
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([row[0] for row in rows], [row[1] for row in rows], color=["#4c72b0", "#55a868", "#c44e52"])
    ax.set_xlabel("decode tok/s (median)")
    layout = os.environ.get(LINEAR_LAYOUT_ENV) or "measured per shape"
    ax.set_title(f"single stream, float32 weights' layout: {layout}", fontsize=9)
    common.save_results("overlap", False, {**common.machine_info(args.dtype), "linear_layout": layout},
                        {"table": table, "same_tokens": same, "rates": rates}, fig)


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


def _mlx_lm(model, tokenizer, prompt: list[int], max_tokens: int) -> tuple[list[float], list[int]]:
    from mlx_lm import stream_generate

    stamps, token_ids = [], []
    for response in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens):
        stamps.append(time.perf_counter())
        token_ids.append(response.token)
    return stamps, token_ids


if __name__ == "__main__":
    main()
