"""Prefix caching: prefill work with the cache off and on, on two workloads.

shared system prompt: a burst of chat requests with one ~200-token system prompt and different
    user questions, all arriving at once.
multi-turn chat: one conversation, a turn at a time; turn k's prompt is turns 1..k-1 with their
    answers plus a new question, so each prompt extends the last. The answers are generated in the
    cache-off run and replayed in the cache-on run, so both modes prefill exactly the same prompts.
Each (workload, mode) runs on a fresh engine over the same weights. "Prefill computed" counts the
prompt tokens that went through the model (Engine.num_computed_prompt_tokens).
"""

from __future__ import annotations

import common
import numpy as np
from matplotlib import pyplot as plt

SYSTEM = (
    "You are CodePilot, a careful senior software engineer who helps developers write, review and debug "
    "code. Follow these rules in every answer. First, restate the problem in one sentence so the user can "
    "check that you understood it. Second, prefer the standard library over third-party packages unless the "
    "user names a package, and say which Python version your code needs. Third, write small functions with "
    "type hints and docstrings, and keep every line under one hundred characters. Fourth, when the question "
    "is about a bug, explain the root cause before you show the fix, and show the smallest change that fixes "
    "it. Fifth, include a short example of how to call the code, and mention the edge cases you considered: "
    "empty inputs, very large inputs, unicode text and concurrent callers. Sixth, if the request is "
    "ambiguous, state the assumption you made instead of asking a question. Never invent APIs; if you are "
    "not sure that a function exists, say so. Answer in English, in Markdown, with code in fenced blocks."
)
QUESTIONS = [
    "How do I reverse a linked list in place?",
    "Write a function that checks whether a string is a palindrome, ignoring punctuation.",
    "What is the difference between a list and a tuple?",
    "How can I read a large CSV file without loading it all into memory?",
    "Why does my recursive Fibonacci function get slow for n above 35?",
    "Write a decorator that retries a function three times on ConnectionError.",
    "How do I merge two sorted lists into one sorted list?",
    "Explain what a Python generator is, with an example.",
    "How do I remove duplicates from a list while keeping the order?",
    "Write a function that flattens an arbitrarily nested list.",
    "How do I time how long a block of code takes to run?",
    "What does the `with` statement do, and how do I write my own context manager?",
    "Write a binary search over a sorted list of integers.",
    "How do I parse command-line arguments with subcommands?",
    "Why does `a = b = []` make both names change together?",
    "Write an LRU cache class without using functools.",
    "How do I run two HTTP requests concurrently with asyncio?",
    "How do I count word frequencies in a text file?",
    "What is the GIL, and when does it matter for performance?",
    "Write a function that validates an IPv4 address string.",
    "How do I serialise a dataclass to JSON and back?",
    "How can I find the k largest numbers in a list of a million numbers?",
    "Write a thread-safe counter class.",
    "How do I walk a directory tree and list every .py file?",
]
CHAT_TURNS = [
    "Write a Python class for a simple in-memory key-value store with get, set and delete.",
    "Add an expiry time (TTL) to each key.",
    "Make it safe to use from several threads at once.",
    "Add a method that returns the number of keys that have not expired.",
    "Write pytest tests for the TTL behaviour.",
    "Now persist the store to a JSON file on every write.",
    "Writing on every set is slow. Batch the writes instead.",
    "Summarise the final design in five bullet points.",
]
WORKLOADS = {
    "full": {"num_shared": 24, "shared_output_len": 32, "num_turns": 8, "turn_output_len": 64},
    "quick": {"num_shared": 4, "shared_output_len": 4, "num_turns": 2, "turn_output_len": 4},
}
MODES = {"cache off": False, "cache on": True}


def main() -> None:
    args, info, workload, loaded = common.start(__doc__, WORKLOADS)
    common.warm_up(loaded)

    prompts = [loaded.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": q}])
               for q in QUESTIONS[:workload["num_shared"]]]
    params = [common.fixed_length(workload["shared_output_len"])] * len(prompts)
    results = {"shared system prompt": {}, "multi-turn chat": {}}
    turn_ttfts: dict[str, list[float]] = {}
    chat_prompts: list[list[int]] = []
    for mode, caching in MODES.items():
        engine = common.new_engine(loaded, enable_prefix_caching=caching)
        run = common.run_tinymlx(engine, prompts, params, desc=f"shared prompt, {mode}")
        results["shared system prompt"][mode] = _measure(engine, [run])

        engine = common.new_engine(loaded, enable_prefix_caching=caching)
        if not chat_prompts:  # the cache-off run writes the conversation; the cache-on run replays it
            runs = _chat(engine, loaded.tokenizer, workload, chat_prompts)
        else:
            runs = [common.run_tinymlx(engine, [p], [common.fixed_length(workload["turn_output_len"])],
                                       desc=f"turn {k + 1}, {mode}") for k, p in enumerate(chat_prompts)]
        results["multi-turn chat"][mode] = _measure(engine, runs)
        turn_ttfts[mode] = [run.requests[0].ttft_s for run in runs]
        del engine

    headers = ["workload", "cache", "requests", "prompt tokens", "prefill computed", "saved",
               "block hit rate", "mean TTFT s", "makespan s"]
    rows = [[name, mode, m["num_requests"], m["num_prompt_tokens"], m["num_computed_prompt_tokens"],
             f"{m['fraction_saved']:.1%}", f"{m['prefix_hit_rate']:.1%}", m["mean_ttft_s"], m["makespan_s"]]
            for name, modes in results.items() for mode, m in modes.items()]
    num_system = len(loaded.tokenizer.encode(SYSTEM))
    table = common.print_table(f"prefix caching, system prompt of {num_system} tokens, dtype {info['dtype']}",
                               headers, rows)
    ratios = {name: {"prefill_saved_vs_off": 1 - m["cache on"]["num_computed_prompt_tokens"]
                     / m["cache off"]["num_computed_prompt_tokens"],
                     "mean_ttft_on_over_off": m["cache on"]["mean_ttft_s"] / m["cache off"]["mean_ttft_s"]}
              for name, m in results.items()}
    for name, r in ratios.items():
        print(f"{name}: {r['prefill_saved_vs_off']:.1%} of prefill saved, "
              f"mean TTFT x{r['mean_ttft_on_over_off']:.2f}")

    payload = {"workload": {**workload, "system_prompt_tokens": num_system,
                            "shared_prompt_lengths": [len(p) for p in prompts],
                            "chat_prompt_lengths": [len(p) for p in chat_prompts]},
               "results": results, "ratios": ratios, "turn_ttft_s": turn_ttfts, "table": table}
    common.save_results("prefix", args.quick, info, payload, _plot(results, turn_ttfts))


def _chat(engine, tokenizer, workload: dict, prompts_out: list[list[int]]) -> list[common.Run]:
    """Run the conversation turn by turn, appending each turn's prompt to prompts_out."""
    messages = [{"role": "system", "content": SYSTEM}]
    runs = []
    for k, question in enumerate(CHAT_TURNS[:workload["num_turns"]]):
        messages.append({"role": "user", "content": question})
        prompt = tokenizer.apply_chat_template(messages)
        run = common.run_tinymlx(engine, [prompt], [common.fixed_length(workload["turn_output_len"])],
                                 desc=f"turn {k + 1}, cache off")
        # EOS is ignored so every turn costs the same; the history keeps the answer up to its EOS.
        answer = run.outputs[0].token_ids
        end = next((i for i, t in enumerate(answer) if t in tokenizer.eos_token_ids), len(answer))
        messages.append({"role": "assistant", "content": tokenizer.decode(answer[:end])})
        prompts_out.append(prompt)
        runs.append(run)
    return runs


def _measure(engine, runs: list[common.Run]) -> dict:
    requests = [r for run in runs for r in run.requests]
    num_prompt = sum(r.num_prompt_tokens for r in requests)
    stats = engine.stats()
    return {
        "num_requests": len(requests),
        "num_prompt_tokens": num_prompt,
        "num_computed_prompt_tokens": stats.num_computed_prompt_tokens,
        "fraction_saved": 1 - stats.num_computed_prompt_tokens / num_prompt,
        "prefix_hit_rate": stats.prefix_hit_rate,
        "mean_ttft_s": float(np.mean([r.ttft_s for r in requests])),
        "makespan_s": sum(run.makespan_s for run in runs),
    }


def _plot(results: dict, turn_ttfts: dict[str, list[float]]) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(results))
    for k, mode in enumerate(MODES):
        computed = [results[name][mode]["num_computed_prompt_tokens"] for name in results]
        left.bar(x + (k - 0.5) * 0.4, computed, width=0.4, label=mode)
    left.set_xticks(x, list(results))
    left.set_ylabel("prompt tokens run through the model")
    left.set_title("prefill work")
    left.legend()
    for mode, ttfts in turn_ttfts.items():
        right.plot(range(1, len(ttfts) + 1), ttfts, "o-", label=mode)
        right.set_xticks(range(1, len(ttfts) + 1))
    right.set_xlabel("turn")
    right.set_ylabel("TTFT (s)")
    right.set_title("multi-turn chat: time to first token per turn")
    right.legend()
    return fig


if __name__ == "__main__":
    main()
