"""Speculative decoding on vs off, on the same engine and prompts, in one run.

Workloads (greedy; each (workload, mode) on a fresh engine over the same loaded weights):
  - code edit: a real 150-400 token function (Python's standard library) in the prompt and an
    instruction that rewrites part of it, up to 160 output tokens (EOS ends a reply): single stream
    (the prompts one after another) and concurrency 8 (eight at once);
  - chat: free-form questions with little to copy, up to 96 output tokens: single stream and
    concurrency 16.
Reported: decode tok/s per stream (tokens after the first over the time after the first), aggregate
generated tok/s, the on/off ratios, the acceptance rate and mean accepted length (tokens a verifying
step yields), and whether every output is identical. Speculation: --speculative (default "ngram").
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import shlex
import textwrap

import common
import numpy as np
from matplotlib import pyplot as plt

from tinymlx import SamplingParams

ASKS = [
    "Add type hints to this function. Reply with the whole function.",
    "Rename the local variables of this function to clearer names, changing nothing else. Reply with the whole function.",
    "Add a docstring to this function, changing nothing else. Reply with the whole function.",
    "Replace the string formatting in this function with f-strings. Reply with the whole function.",
]
CHAT = [
    "What did the Roman Empire contribute to modern law?", "Write a short poem about autumn rain.",
    "Why is the sky blue? Explain it to a ten-year-old.", "Give me three ideas for a rainy Sunday.",
    "What is the difference between weather and climate?", "Describe the taste of a ripe mango.",
    "How do bees make honey?", "Summarize the plot of Romeo and Juliet.",
    "What makes a good teacher?", "Tell me a fun fact about octopuses.",
    "How does a bicycle stay upright?", "What should I pack for a weekend hike?",
    "Why do cats purr?", "Explain compound interest simply.",
    "What is the tallest mountain in Africa?", "Write a haiku about the sea.",
]
WORKLOADS = {
    "full": {"code": {"single": 4, "concurrent": 8, "max_tokens": 160},
             "chat": {"single": 4, "concurrent": 16, "max_tokens": 96}},
    "quick": {"code": {"single": 1, "concurrent": 2, "max_tokens": 24},
              "chat": {"single": 1, "concurrent": 2, "max_tokens": 16}},
}
BARS = {("code", "single"): 2.0, ("code", "concurrent"): 1.3, ("chat", "single"): 0.95, ("chat", "concurrent"): 0.95}


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--speculative", default="ngram", help="the speculation to measure (default: ngram)")
    args, info, workload, loaded = common.start(__doc__, WORKLOADS, parser)
    prompts = {"code": _code_prompts(loaded.tokenizer), "chat": [
        loaded.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT]}
    common.warm_up(loaded)

    results: dict[str, dict] = {}
    for name, shape in workload.items():
        for mode in ("single", "concurrent"):
            n = shape[mode]
            chosen = prompts[name][:n]
            params = [SamplingParams(temperature=0.0, max_tokens=shape["max_tokens"])] * n
            runs = {}
            for speculative in (None, args.speculative):
                label = "on" if speculative else "off"
                engine = common.new_engine(loaded, speculative=speculative)
                wave = 1 if mode == "single" else None  # single: one prompt after another
                run = common.run_tinymlx(engine, chosen, params, wave_size=wave, desc=f"{name} {mode} {label}")
                stats = engine.stats()
                runs[label] = {**common.summarize(run), "acceptance_rate": stats.acceptance_rate,
                               "mean_accepted_length": stats.mean_accepted_length, "num_steps": engine.num_steps,
                               "outputs": [o.token_ids for o in run.outputs]}
            on, off = runs["on"], runs["off"]
            results[f"{name} {mode}"] = {
                "workload": name, "mode": mode, "num_requests": n, "on": _without_outputs(on),
                "off": _without_outputs(off), "identical": on["outputs"] == off["outputs"],
                "decode_ratio": on["decode_tok_s_per_stream"] / off["decode_tok_s_per_stream"],
                "gen_ratio": on["gen_tok_s"] / off["gen_tok_s"],
                "bar": BARS[name, mode],
            }

    table = _table(results)
    payload = {"workload": {**workload, "seed": args.seed}, "speculative": args.speculative,
               "results": results, "table": table}
    common.save_results("speculative", args.quick, info, payload, _plot(results))


def _code_prompts(tokenizer) -> list[list[int]]:
    """Standard-library functions of 150-400 tokens, each with an edit instruction."""
    modules = (difflib, textwrap, shlex, json.decoder, argparse)
    functions = [f for m in modules for _, f in inspect.getmembers(m, inspect.isfunction) if f.__module__ == m.__name__]
    sized = [f for f in functions if 150 <= len(tokenizer.encode(inspect.getsource(f))) <= 400]
    prompts = []
    for i, function in enumerate(sorted(sized, key=lambda f: f.__qualname__)[:8]):
        message = f"{ASKS[i % len(ASKS)]}\n\n```python\n{textwrap.dedent(inspect.getsource(function))}```"
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": message}]))
    return prompts


def _without_outputs(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "outputs"}


def _table(results: dict) -> dict:
    headers = ["workload", "mode", "requests", "decode tok/s off", "decode tok/s on", "x decode", "gen tok/s off",
               "gen tok/s on", "x gen", "bar", "acceptance", "mean accepted", "identical"]
    rows = []
    for r in results.values():
        ratio = r["decode_ratio"] if r["mode"] == "single" else r["gen_ratio"]
        rows.append([r["workload"], r["mode"], r["num_requests"], r["off"]["decode_tok_s_per_stream"],
                     r["on"]["decode_tok_s_per_stream"], r["decode_ratio"], r["off"]["gen_tok_s"], r["on"]["gen_tok_s"],
                     r["gen_ratio"], f"{'met' if ratio >= r['bar'] else 'MISSED'} ({r['bar']}x)",
                     f"{r['on']['acceptance_rate']:.0%}", r["on"]["mean_accepted_length"],
                     "yes" if r["identical"] else "NO"])
    return common.print_table("speculative decoding on vs off (bars: single stream on decode tok/s, "
                              "concurrent on aggregate tok/s)", headers, rows)


def _plot(results: dict) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(results)
    x = np.arange(len(names))
    ratios = [r["decode_ratio"] if r["mode"] == "single" else r["gen_ratio"] for r in results.values()]
    bars = left.bar(x, ratios, color=["#2e75b6" if ratio >= r["bar"] else "#c0504d"
                                      for ratio, r in zip(ratios, results.values())])
    left.bar_label(bars, fmt="%.2fx")
    left.scatter(x, [r["bar"] for r in results.values()], marker="_", s=900, color="black", label="bar")
    left.axhline(1.0, color="gray", linewidth=0.8)
    left.set_xticks(x, names)
    left.set_title("speculation on / off (single: decode tok/s; concurrent: aggregate)")
    left.legend()
    right.bar(x, [r["on"]["mean_accepted_length"] for r in results.values()], color="#c8a040")
    for i, r in enumerate(results.values()):
        right.annotate(f"{r['on']['acceptance_rate']:.0%} accepted", (i, r["on"]["mean_accepted_length"]),
                       ha="center", va="bottom")
    right.set_xticks(x, names)
    right.set_title("tokens per verifying step")
    return fig


if __name__ == "__main__":
    main()
