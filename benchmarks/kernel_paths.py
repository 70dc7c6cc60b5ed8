"""Prefill and decode tok/s of the CPU's kernels against the portable ones (tinymlx/ops/kernels.py), one model.

Rounds alternate the two sets of kernels on one loaded model (model code reads the choice at each call),
so both run the same weights and see the machine's load drift alike. Prefill: one request of `--prompt`
random token ids, max_tokens=1, prefix caching off: prompt tokens / TTFT. Decode: one request, `--tokens`
greedy tokens with EOS ignored: (tokens - 1) / (e2e - TTFT). Each figure is the median over `--rounds`.

    python benchmarks/kernel_paths.py [--model MODEL] [--dtype float32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from tinymlx import LLM, SamplingParams
from tinymlx.ops import cpu, kernels, portable

PATHS = {"cpu": cpu.KERNELS, "portable": portable.KERNELS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded offline model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt", type=int, default=512, help="prefill prompt length (tokens)")
    parser.add_argument("--tokens", type=int, default=64, help="decode length (tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1000, 20000, args.prompt).tolist()
    short = rng.integers(1000, 20000, 16).tolist()
    prefill_params = SamplingParams(temperature=0.0, max_tokens=1)
    decode_params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    kernels.use(PATHS["cpu"])
    llm.generate([short], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up: first-call costs
    results: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in PATHS}
    outputs: dict[str, list[int]] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms each path up (mx.compile's first trace) untimed
        for name, chosen in PATHS.items():
            kernels.use(chosen)
            metrics = llm.generate([prompt], prefill_params)[0].metrics
            out = llm.generate([short], decode_params)[0]
            if round_:
                results[name]["prefill"].append(args.prompt / metrics.ttft_s)
                results[name]["decode"].append((args.tokens - 1) / (out.metrics.e2e_s - out.metrics.ttft_s))
            outputs[name] = list(out.token_ids)
            print(f"round {round_} {name}: prefill {args.prompt / metrics.ttft_s:.1f} tok/s, decode "
                  f"{(args.tokens - 1) / (out.metrics.e2e_s - out.metrics.ttft_s):.2f} tok/s", flush=True)
    same = sum(a == b for a, b in zip(outputs["cpu"], outputs["portable"]))
    print(f"\ngreedy tokens equal on both paths: {same}/{args.tokens}")
    print(f"{'path':10} {'prefill tok/s':>14} {'decode tok/s':>13}   (median of {args.rounds}; all rounds)")
    for name, figures in results.items():
        print(f"{name:10} {statistics.median(figures['prefill']):14.1f} {statistics.median(figures['decode']):13.2f}"
              f"   prefill {[round(x, 1) for x in figures['prefill']]}, decode {[round(x, 2) for x in figures['decode']]}")


if __name__ == "__main__":
    main()
