"""An agent's tool loop: 6 turns, a 2,000-token system prompt and 4 tools, through each API.

tinymlx serves the loop through chat/completions (tools), /v1/messages and /v1/responses;
mlx_lm.server serves it through chat/completions with tools. Each loop is the same scripted
conversation, as a coding agent drives one: the user states a task, then every turn adds the agent's
previous tool call and its result (each API's own form: tool_calls and role "tool", tool_use and
tool_result blocks, function_call and function_call_output items). The system prompt's first line names
the loop, so the three loops through one tinymlx server share no cached block; mlx-lm's loop is
byte-identical to tinymlx's chat loop. Each loop runs `repeats` times over (its first line numbers the
repeat too: nothing cached is shared between repeats), and a turn's TTFT is the median of its repeats.

One tinymlx server and one mlx_lm.server run on loopback side by side, and the loops take turns: turn k
of every loop and repeat, then turn k + 1. This machine's speed drifts by 15% within minutes, and one
request's TTFT by 10% from the next's; so a turn's measurements lie seconds apart, not a whole loop apart,
and the median of its repeats is what the bar reads. The order rotates at every round, so no loop always
follows the same one (a server's OpenBLAS threads spin on for a while after its last GEMM).

Per turn: TTFT, the latency of a one-token reply to that turn's request at temperature 0 (the
prefill it pays: the prompt minus what the server's cache holds), and the prompt tokens the server
reports served from its cache. The bar: from turn 2 on, tinymlx's TTFT is at most 0.2x its turn 1,
and at most 0.5x mlx_lm.server's on the same turn.
"""

from __future__ import annotations

import json
import time

import common
import httpx
import numpy as np
from http_load import ServerProcess
from matplotlib import pyplot as plt

from tinymlx.text.tokenizer import Tokenizer

WORKLOADS = {
    "full": {"turns": 6, "system_tokens": 2000, "repeats": 3},
    "quick": {"turns": 3, "system_tokens": 300, "repeats": 1},
}
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
LOOPS = (("tinymlx", "chat"), ("tinymlx", "messages"), ("tinymlx", "responses"), ("mlx-lm", "chat"))
TURN_BAR, PEER_BAR = 0.2, 0.5


def _tool(name: str, description: str, properties: dict) -> dict:
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)}}


TOOLS = [
    _tool("read_file", "Read a file of the repository.", {"path": {"type": "string"}}),
    _tool("search_code", "Search the repository for a regular expression.", {"pattern": {"type": "string"}}),
    _tool("run_tests", "Run the test suite, or one test file.", {"target": {"type": "string"}}),
    _tool("write_file", "Replace a file's contents.", {"path": {"type": "string"}, "content": {"type": "string"}}),
]
TASK = "tests/test_cache.py fails with a KeyError. Find the cause and fix it, using the tools."
CALLS = [  # the agent's calls, one a turn, and what each tool answers
    ("read_file", {"path": "tests/test_cache.py"},
     "from cache import Cache\n\ndef test_missing_key_is_none():\n    cache = Cache()\n    cache.set('a', 1)\n"
     "    cache.delete('a')\n    assert cache.get('a') is None\n"),
    ("read_file", {"path": "src/cache.py"},
     "class Cache:\n    def __init__(self):\n        self._items = {}\n\n    def set(self, key, value):\n"
     "        self._items[key] = value\n\n    def get(self, key):\n        return self._items[key]\n\n"
     "    def delete(self, key):\n        del self._items[key]\n"),
    ("search_code", {"pattern": "_items\\["}, "src/cache.py:6: self._items[key] = value\n"
     "src/cache.py:9: return self._items[key]\nsrc/cache.py:12: del self._items[key]\n"),
    ("write_file", {"path": "src/cache.py", "content": "    def get(self, key):\n        return self._items.get(key)\n"},
     "wrote 2 lines to src/cache.py"),
    ("run_tests", {"target": "tests/test_cache.py"}, "1 passed in 0.01s"),
    ("run_tests", {"target": "tests"}, "42 passed in 1.93s"),
]


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.set_defaults(model=DEFAULT_MODEL)
    setup = common.setup(__doc__, WORKLOADS, parser)
    args, workload, model_dir = setup.args, setup.workload, setup.model_dir
    tokenizer = Tokenizer.from_dir(model_dir)
    system = tokenizer.decode(setup.text_ids[:workload["system_tokens"]])
    system = "You are a coding agent. Use the tools to work on the repository below.\n\n" + system

    runs: dict[str, list[list[dict]]] = {f"{server_name} {api}": [] for server_name, api in LOOPS}  # [turn][repeat]
    with (ServerProcess.tinymlx(model_dir, "--dtype", args.dtype) as ours, ServerProcess.mlx_lm(model_dir) as peer,
          httpx.Client(timeout=httpx.Timeout(1800.0)) as http):
        servers = {"tinymlx": ours, "mlx-lm": peer}
        for server in servers.values():  # a process's first forward pays one-off costs: not a turn's
            http.post(server.base_url + _PATHS["chat"], json={"model": server.model, "max_tokens": 1,
                      "messages": [{"role": "user", "content": "warm up"}]}).raise_for_status()
        for turn in range(workload["turns"]):
            for loop in runs.values():
                loop.append([])
            for repeat in range(workload["repeats"]):
                shift = (turn * workload["repeats"] + repeat) % len(LOOPS)
                for server_name, api in LOOPS[shift:] + LOOPS[:shift]:
                    name = f"{server_name} {api}"
                    run = _turn(http, servers[server_name], api, f"[{api} loop {repeat + 1}] {system}", turn)
                    runs[name][turn].append(run)
                    print(f"turn {turn + 1} repeat {repeat + 1} {name}: TTFT {run['ttft_s']:.2f} s, prompt "
                          f"{run['prompt_tokens']}, cached {run['cached_tokens']}", flush=True)

    results = {name: [_median_turn(turn_runs) for turn_runs in loop] for name, loop in runs.items()}
    table = _table(results, workload["turns"])
    payload = {"workload": {**workload, "model": str(args.model), "tools": len(TOOLS)}, "results": results,
               "table": table, "bars": _bars(results, workload["turns"])}
    print(json.dumps(payload["bars"], indent=2))
    common.save_results("agent_loop", args.quick, setup.info, payload, _plot(results))


# -- one turn of a loop ---------------------------------------------------------------------------
def _median_turn(runs: list[dict]) -> dict:
    """A turn over its repeats: the median TTFT (each repeat's kept), the fewest tokens served from cache."""
    least_cached = min(runs, key=lambda run: run["cached_tokens"])
    return {**least_cached, "ttft_s": float(np.median([run["ttft_s"] for run in runs])),
            "ttft_runs_s": [run["ttft_s"] for run in runs]}


def _turn(http: httpx.Client, server: ServerProcess, api: str, system: str, turn: int) -> dict:
    steps = [(f"call_{i}", name, arguments, result) for i, (name, arguments, result) in enumerate(CALLS[:turn])]
    time.sleep(2.0)  # the server before may still be winding down (OpenBLAS threads spin a while after a GEMM)
    started = time.perf_counter()
    response = http.post(server.base_url + _PATHS[api], json=_body(api, server.model, system, steps))
    ttft = time.perf_counter() - started
    response.raise_for_status()
    return {"turn": turn + 1, "ttft_s": ttft, **_usage(api, response.json()["usage"])}


_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def _usage(api: str, usage: dict) -> dict:
    """{"prompt_tokens", "cached_tokens"} from each API's usage."""
    if api == "messages":
        cached = usage.get("cache_read_input_tokens") or 0
        return {"prompt_tokens": usage.get("input_tokens", 0) + cached, "cached_tokens": cached}
    if api == "responses":
        return {"prompt_tokens": usage.get("input_tokens", 0),
                "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)}
    details = usage.get("prompt_tokens_details") or {}
    return {"prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": details.get("cached_tokens", 0)}


# -- each API's request for the same conversation: the task, then (call id, tool, arguments, result) steps ---
def _body(api: str, model: str, system: str, steps: list[tuple]) -> dict:
    if api == "messages":
        return {"model": model, "system": system, "messages": _anthropic_messages(steps), "max_tokens": 1,
                "temperature": 0, "tools": [{"name": t["name"], "description": t["description"],
                                             "input_schema": t["parameters"]} for t in TOOLS]}
    if api == "responses":
        return {"model": model, "instructions": system, "input": _responses_input(steps), "store": False,
                "max_output_tokens": 1, "temperature": 0, "tools": [{"type": "function", **t} for t in TOOLS]}
    return {"model": model, "messages": [{"role": "system", "content": system}, *_chat_messages(steps)],
            "max_tokens": 1, "temperature": 0, "tools": [{"type": "function", "function": t} for t in TOOLS]}


def _chat_messages(steps: list[tuple]) -> list[dict]:
    messages = [{"role": "user", "content": TASK}]
    for call_id, name, arguments, result in steps:
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return messages


def _anthropic_messages(steps: list[tuple]) -> list[dict]:
    messages = [{"role": "user", "content": TASK}]
    for call_id, name, arguments, result in steps:
        messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": call_id, "name": name, "input": arguments}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call_id, "content": result}]})
    return messages


def _responses_input(steps: list[tuple]) -> list[dict]:
    items = [{"role": "user", "content": TASK}]
    for call_id, name, arguments, result in steps:
        items.append({"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps(arguments)})
        items.append({"type": "function_call_output", "call_id": call_id, "output": result})
    return items


# -- report --------------------------------------------------------------------------------------
def _table(results: dict[str, list[dict]], turns: int) -> dict:
    headers = ["turn"] + [f"{name} TTFT s" for name in results] + [f"{name} cached/prompt" for name in results]
    rows = []
    for turn in range(turns):
        rows.append([turn + 1] + [loop[turn]["ttft_s"] for loop in results.values()]
                    + [f"{loop[turn]['cached_tokens']}/{loop[turn]['prompt_tokens']}" for loop in results.values()])
    return common.print_table("Agent loop: TTFT per turn and prompt tokens served from cache", headers, rows)


def _bars(results: dict[str, list[dict]], turns: int) -> dict:
    peer = results["mlx-lm chat"]
    bars = {}
    for name, loop in results.items():
        if name.startswith("mlx-lm"):
            continue
        first = loop[0]["ttft_s"]
        vs_turn_1 = [loop[t]["ttft_s"] / first for t in range(1, turns)]
        vs_peer = [loop[t]["ttft_s"] / peer[t]["ttft_s"] for t in range(1, turns)]
        bars[name] = {"ttft_vs_turn_1": [round(r, 3) for r in vs_turn_1],
                      "ttft_vs_mlx_lm": [round(r, 3) for r in vs_peer],
                      "meets_bar": max(vs_turn_1) <= TURN_BAR and max(vs_peer) <= PEER_BAR}
    return bars


def _plot(results: dict[str, list[dict]]) -> plt.Figure:
    fig, (ttft_ax, cache_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, loop in results.items():
        turns = [t["turn"] for t in loop]
        style = "--" if name.startswith("mlx-lm") else "-"
        medians = np.array([t["ttft_s"] for t in loop])
        spread = [medians - [min(t["ttft_runs_s"]) for t in loop], [max(t["ttft_runs_s"]) for t in loop] - medians]
        ttft_ax.errorbar(turns, medians, yerr=spread, fmt=style, marker="o", capsize=3, label=name)
        cache_ax.plot(turns, [t["cached_tokens"] / max(1, t["prompt_tokens"]) for t in loop], style, marker="o",
                      label=name)
    ttft_ax.set(xlabel="turn", ylabel="TTFT (s, log)", yscale="log",
                title="Time to first token per turn (median, bars: min-max of repeats)")
    cache_ax.set(xlabel="turn", ylabel="share of the prompt from cache", ylim=(0, 1.05),
                 title="Prompt tokens served from cache")
    for ax in (ttft_ax, cache_ax):
        ax.grid(alpha=0.3)
        ax.set_xticks(np.arange(1, len(next(iter(results.values()))) + 1))
    ttft_ax.legend()
    return fig


if __name__ == "__main__":
    main()
