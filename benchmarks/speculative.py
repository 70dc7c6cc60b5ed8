"""Speculative decoding on vs off, on the same engines and prompts, in one run.

Rows (each (row, on/off) on a fresh engine over weights loaded once; EOS ends a reply):
  - free text, draft pair: explanations, Qwen2.5-Coder-1.5B-Instruct drafted by the 0.5B (same
    vocabulary), one stream (the prompts one after another), greedy and seeded sampling at T=0.7;
  - code edits, n-gram: a real 150-400 token function (Python's standard library) in the prompt and an
    instruction that rewrites part of it, on the 0.5B: one stream, and eight at once (greedy and T=0.7);
  - chat, n-gram: free-form questions with little to copy, sixteen at once on the 0.5B;
  - mixed, both proposers: half code edits, half chat, eight at once on the 1.5B, "ngram+draft".
Reported: decode tok/s per stream (tokens after the first over the time after the first), aggregate
generated tok/s, the on/off ratios (single stream: decode tok/s; concurrent: aggregate) against each
row's bar, the acceptance per proposer, whether every output is identical to plain decoding (greedy, or
the same seeds), and the step-cost curve each engine learned (seconds of a target forward by rows).
"""

from __future__ import annotations

import argparse
import difflib
import heapq
import inspect
import json
import shlex
import textwrap
from dataclasses import dataclass

import common
import numpy as np
from matplotlib import pyplot as plt

from tinymlx import Engine, EngineConfig, SamplingParams
from tinymlx.ops.cpu.linear import step_cost as cpu_row_cost

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
EXPLAIN = [
    "Explain how a hash table handles collisions, and what makes lookups fast on average.",
    "Explain what a Python decorator is and when you would write one.",
    "Explain the difference between a process and a thread.",
]
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


@dataclass(frozen=True)
class Row:
    name: str
    model: str  # "target" (the 1.5B) or "draft" (the 0.5B, n-gram rows' model)
    prompts: str  # "explain" | "code" | "chat" | "mixed"
    num_requests: int
    concurrent: bool
    speculative: str
    temperature: float
    bar: float | None  # on / off: single stream on decode tok/s, concurrent on aggregate tok/s


def rows(quick: bool) -> tuple[list[Row], dict[str, int]]:
    """The rows, and max_tokens per kind of prompt. An edit replies with the whole function it rewrites
    (150-400 tokens): 256 lets a reply carry most of it, where 96 cut each at a third."""
    n = (lambda full, small: small) if quick else (lambda full, small: full)
    return [
        Row("free text, draft pair", "target", "explain", n(2, 1), False, f"draft:{DRAFT}", 0.0, 1.3),
        Row("free text, draft pair, T=0.7", "target", "explain", n(2, 1), False, f"draft:{DRAFT}", 0.7, None),
        Row("code edits", "draft", "code", n(4, 1), False, "ngram", 0.0, 2.0),
        Row("code edits", "draft", "code", n(8, 2), True, "ngram", 0.0, 1.2),
        Row("code edits, T=0.7", "draft", "code", n(8, 2), True, "ngram", 0.7, None),
        Row("chat", "draft", "chat", n(16, 2), True, "ngram", 0.0, 1.0),
        Row("mixed, both proposers", "target", "mixed", n(8, 2), True, f"ngram+draft:{DRAFT}", 0.0, 1.2),
    ], {"explain": n(64, 12), "code": n(256, 16), "chat": n(96, 12), "mixed": n(96, 12)}


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    if args.model:  # the rows name their models: the pair shares a vocabulary, and the n-gram rows use the 0.5B
        parser.error(f"--model: this benchmark runs {TARGET} and {DRAFT}, its rows' models")
    common.check_blas()
    info = common.machine_info(args.dtype)
    models = {"target": common.load_tinymlx(TARGET, args.dtype), "draft": common.load_tinymlx(DRAFT, args.dtype)}
    common.warm_up(models["target"])
    common.warm_up(models["draft"])
    plan, max_tokens = rows(args.quick)
    results: dict[str, dict] = {}
    for row in plan:
        loaded = models[row.model]
        prompts = _prompts(row.prompts, loaded.tokenizer)[:row.num_requests]
        limit = max_tokens[row.prompts]
        params = [SamplingParams(temperature=row.temperature, seed=i if row.temperature else None, max_tokens=limit)
                  for i in range(len(prompts))]
        runs = {}
        for label, speculative in (("off", None), ("on", row.speculative)):
            draft = models["draft"].model if speculative and "draft:" in speculative else None
            engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(speculative=speculative),
                            model_name=loaded.model_dir.name, draft_model=draft)
            run = common.run_tinymlx(engine, prompts, params, wave_size=None if row.concurrent else 1,
                                     desc=f"{row.name} {label}")
            stats = engine.stats()
            runs[label] = {**common.summarize(run), "num_steps": engine.num_steps,
                           "acceptance": {p.name: p.acceptance_rate for p in stats.proposers},
                           "drafted": {p.name: p.num_draft_tokens for p in stats.proposers},
                           "mean_accepted_length": stats.mean_accepted_length,
                           "step_cost": [list(point) for point in stats.step_cost],
                           "draft_step_cost": [list(point) for point in stats.draft_step_cost],
                           "outputs": [o.token_ids for o in run.outputs]}
        on, off = runs["on"], runs["off"]
        key = f"{row.name}, {'concurrency ' + str(len(prompts)) if row.concurrent else 'single stream'}"
        ratio_of = "gen_tok_s" if row.concurrent else "decode_tok_s_per_stream"
        results[key] = {
            "row": row.__dict__, "model": models[row.model].model_dir.name, "max_tokens": limit,
            "on": _without_outputs(on), "off": _without_outputs(off), "identical": on["outputs"] == off["outputs"],
            "decode_ratio": on["decode_tok_s_per_stream"] / off["decode_tok_s_per_stream"],
            "gen_ratio": on["gen_tok_s"] / off["gen_tok_s"], "ratio": on[ratio_of] / off[ratio_of],
        }
        print(f"{key}: {results[key]['ratio']:.2f}x, identical {results[key]['identical']}, "
              f"acceptance {on['acceptance']}")

    table = _table(results)
    payload = {"workload": {"max_tokens": max_tokens, "seed": args.seed, "target": TARGET, "draft": DRAFT},
               "results": results, "table": table, "learned_curves": _curves_table(results)}
    common.save_results("speculative", args.quick, info, payload, _plot(results))


def _prompts(kind: str, tokenizer) -> list[list[int]]:
    chat = lambda questions: [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]  # noqa: E731
    if kind == "mixed":  # edits and questions alternating, so any prefix of it is half of each
        return [p for pair in zip(_code_prompts(tokenizer), chat(CHAT)) for p in pair]
    return {"explain": lambda: chat(EXPLAIN), "code": lambda: _code_prompts(tokenizer), "chat": lambda: chat(CHAT)}[kind]()


def _code_prompts(tokenizer) -> list[list[int]]:
    """Standard-library functions of 150-400 tokens, each with an edit instruction."""
    modules = (difflib, textwrap, shlex, json.decoder, argparse, heapq)  # eight of that size
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
    headers = ["row", "model", "decode tok/s off", "decode tok/s on", "x decode", "gen tok/s off", "gen tok/s on",
               "x gen", "bar", "acceptance", "tokens / verify", "identical"]
    table_rows = []
    for key, r in results.items():
        bar = r["row"]["bar"]
        verdict = "-" if bar is None else f"{'met' if r['ratio'] >= bar else 'MISSED'} ({bar}x)"
        acceptance = ", ".join(f"{name} {rate:.0%} of {r['on']['drafted'][name]}"
                               for name, rate in r["on"]["acceptance"].items())
        table_rows.append([key, r["model"].replace("-instruct", ""), r["off"]["decode_tok_s_per_stream"],
                           r["on"]["decode_tok_s_per_stream"], r["decode_ratio"], r["off"]["gen_tok_s"],
                           r["on"]["gen_tok_s"], r["gen_ratio"], verdict, acceptance, r["on"]["mean_accepted_length"],
                           "yes" if r["identical"] else "NO"])
    return common.print_table("speculative decoding on vs off (bars: single stream on decode tok/s, concurrent on "
                              "aggregate tok/s)", headers, table_rows)


def _curves_table(results: dict) -> dict:
    """The step-cost curve each speculating engine learned: a target forward's seconds at some row counts,
    and against the prior's shape (the seconds of one row times the CPU table)."""
    counts = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    headers = ["row", "curve", *[f"{n} rows" for n in counts]]
    table_rows = []
    for key, r in results.items():
        for curve in ("step_cost", "draft_step_cost"):
            points = dict(map(tuple, r["on"][curve]))
            if points:
                table_rows.append([key, "target" if curve == "step_cost" else "draft model",
                                   *[_at(points, n) for n in counts]])
    return common.print_table("learned step cost, seconds (interpolated between the row counts measured; "
                              "- : beyond them)", headers, table_rows)


def _at(points: dict[int, float], rows: int):
    keys = sorted(points)
    if rows < keys[0] or rows > keys[-1]:
        return "-"
    return float(np.interp(rows, keys, [points[k] for k in keys]))


def _plot(results: dict) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.8))
    names = list(results)
    x = np.arange(len(names))
    ratios = [r["ratio"] for r in results.values()]
    bars = left.bar(x, ratios, color=["#999999" if r["row"]["bar"] is None else
                                      "#2e75b6" if ratio >= r["row"]["bar"] else "#c0504d"
                                      for ratio, r in zip(ratios, results.values())])
    left.bar_label(bars, fmt="%.2fx")
    with_bars = [(i, r["row"]["bar"]) for i, r in enumerate(results.values()) if r["row"]["bar"] is not None]
    left.scatter([i for i, _ in with_bars], [b for _, b in with_bars], marker="_", s=900, color="black", label="bar")
    left.axhline(1.0, color="gray", linewidth=0.8)
    left.set_xticks(x, [n.replace(", ", "\n") for n in names], fontsize=7)
    left.set_title("speculation on / off (single: decode tok/s; concurrent: aggregate; grey: no bar)")
    left.legend()
    for key, r in results.items():
        points = sorted(tuple(p) for p in r["on"]["step_cost"])
        if points:
            rows_, seconds = zip(*points)
            right.plot(rows_, seconds, marker=".", label=f"{key} ({r['model'].replace('-instruct', '')})")
    first = next((r for r in results.values() if r["on"]["step_cost"]), None)
    if first is not None:
        one = dict(map(tuple, first["on"]["step_cost"])).get(1)
        if one:
            grid = np.arange(1, 65)
            right.plot(grid, [one * cpu_row_cost(int(n)) for n in grid], "k--", linewidth=0.8,
                       label=f"prior (CPU table) x the one-row step of {first['model'].split('-q')[0]}")
    right.set_xscale("log", base=2)
    right.set_xlabel("rows in the target's forward")
    right.set_ylabel("seconds (learned)")
    right.set_title("learned step-cost curves")
    right.legend(fontsize=6)
    return fig


if __name__ == "__main__":
    main()
