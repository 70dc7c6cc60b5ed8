"""A long prompt's time to first token: what an agent's first turn pays (10-20k tokens of system prompt,
tools and files), on the portable kernels (what a Mac runs), the CPU's kernels and mlx-lm, one after the
other in one process for each prompt length.

One request of N tokens of real text, nothing cached, one greedy token out: tinymlx on a fresh engine with
its default chunking (`max_num_batched_tokens` 512), mlx-lm's stream_generate with its default prefill
step (2,048). The tokens of the first reply are compared too.

    python benchmarks/long_prompt.py [--lengths 2048 8192] [--quick]
"""

from __future__ import annotations

import sys
import time

import common
import mlx.core as mx
from matplotlib import pyplot as plt

WORKLOADS = {"full": {"lengths": [2048, 8192]}, "quick": {"lengths": [512]}}
ENGINES = ("tinymlx, portable kernels", "tinymlx, CPU kernels", "mlx-lm")


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt lengths (default: the workload's)")
    args = parser.parse_args()
    common.check_blas()
    import mlx_lm  # only here: it pulls in transformers, which tinymlx never loads

    lengths = args.lengths or WORKLOADS["quick" if args.quick else "full"]["lengths"]
    loaded_portable = common.load_tinymlx_for(args.model, args.dtype, portable=True)  # linears stay nn.Linear
    loaded = common.load_tinymlx_for(args.model, args.dtype, portable=False)
    common.warm_up(loaded)
    model, tokenizer = mlx_lm.load(str(loaded.model_dir))
    text = common.text_token_ids(loaded.tokenizer)
    runs = {ENGINES[0]: lambda prompt: _portable(loaded_portable, prompt), ENGINES[1]: lambda prompt: _tinymlx(loaded, prompt),
            ENGINES[2]: lambda prompt: _mlx_lm(model, tokenizer, prompt)}
    rows, seconds = [], {name: [] for name in ENGINES}
    for length in lengths:
        prompt = text[2000:2000 + length]
        found = {}
        for name, run in runs.items():
            seconds[name].append(0.0)
            seconds[name][-1], found[name] = run(prompt)
            print(f"{length} tokens, {name}: {seconds[name][-1]:.1f} s", file=sys.stderr, flush=True)
        peer = seconds["mlx-lm"][-1]
        rows += [[length, name, seconds[name][-1], length / seconds[name][-1], seconds[name][-1] / peer,
                  found[name] == found["mlx-lm"]] for name in ENGINES]
    table = common.print_table(f"TTFT of one prompt, nothing cached ({loaded.model_dir.name})",
                               ["prompt tokens", "engine", "TTFT s", "prefill tok/s", "x mlx-lm", "same token"], rows)
    fig, ax = plt.subplots(figsize=(6, 3))
    width = 0.8 / len(ENGINES)
    for i, name in enumerate(ENGINES):
        ax.bar([j + i * width for j in range(len(lengths))], seconds[name], width, label=name)
    ax.set_xticks([j + width for j in range(len(lengths))], [f"{n:,} tokens" for n in lengths])
    ax.set_ylabel("TTFT s (lower is better)")
    ax.legend(fontsize=8)
    common.save_results("long_prompt", args.quick, common.machine_info(args.dtype), {"table": table}, fig)


def _tinymlx(loaded: common.LoadedModel, prompt: list[int]) -> tuple[float, int]:
    engine = common.new_engine(loaded)
    start = time.perf_counter()
    engine.add_request(prompt, common.fixed_length(1))
    token = None
    while engine.has_unfinished_requests:
        for out in engine.step():
            token = out.token_ids[0] if out.token_ids else token
    return time.perf_counter() - start, token


def _portable(loaded: common.LoadedModel, prompt: list[int]) -> tuple[float, int]:
    with common.portable_kernels():
        return _tinymlx(loaded, prompt)


def _mlx_lm(model, tokenizer, prompt: list[int]) -> tuple[float, int]:
    from mlx_lm import stream_generate

    start = time.perf_counter()
    token = None
    for response in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=1):
        token = response.token
    return time.perf_counter() - start, token


if __name__ == "__main__":
    main()
