"""An agent's tool loop: 6 turns, a 2,000-token system prompt and 4 tools, through each API.

tinymlx serves the loop through chat/completions (tools), /v1/messages and /v1/responses;
mlx_lm.server serves it through chat/completions with tools. Each (server, API) gets a fresh server
process on loopback and the same script: the user asks for a task; a reply that calls tools gets
canned tool results back, a reply in text gets the next user request, so every loop runs 6 turns
whatever the model decides. Greedy (temperature 0), each API's own way of sending the history.

Per turn: TTFT, the latency of a one-token reply to that turn's exact request (the prefill the
turn pays: the prompt minus what the server's cache holds), and the prompt tokens the server
reports served from its cache; then the turn's full reply, streamed, whose time to the first
visible delta (text or a call) is also recorded. The bar: from turn 2 on, tinymlx's TTFT is at most
0.2x its turn 1, and at most 0.5x mlx_lm.server's on the same turn.
"""

from __future__ import annotations

import json
import time

import common
import httpx
import numpy as np
from http_load import ServerProcess
from matplotlib import pyplot as plt

from tinymlx.tokenizer import Tokenizer

WORKLOADS = {
    "full": {"turns": 6, "system_tokens": 2000, "max_tokens": 96},
    "quick": {"turns": 3, "system_tokens": 300, "max_tokens": 32},
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
USER_TURNS = [
    "The test tests/test_cache.py fails with a KeyError. Find the cause using the tools.",
    "Look at the cache module that test imports.",
    "Search for where the key is deleted.",
    "Run that test file again.",
    "Write the fix to the cache module.",
    "Run the whole test suite.",
]
TOOL_RESULT = "OK: 14 lines. def get(self, key):\n    return self._items[key]  # raises KeyError when missing"


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.set_defaults(model=DEFAULT_MODEL)
    setup = common.setup(__doc__, WORKLOADS, parser)
    args, workload, model_dir = setup.args, setup.workload, setup.model_dir
    tokenizer = Tokenizer.from_dir(model_dir)
    system = tokenizer.decode(setup.text_ids[:workload["system_tokens"]])
    system = "You are a coding agent. Use the tools to work on the repository below.\n\n" + system

    results = {}
    for server_name, api in LOOPS:
        server = (ServerProcess.tinymlx(model_dir, "--dtype", args.dtype) if server_name == "tinymlx"
                  else ServerProcess.mlx_lm(model_dir))
        print(f"\n== {server_name} {api}", flush=True)
        with server, httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(1800.0)) as http:
            results[f"{server_name} {api}"] = _loop(http, server.model, api, system, workload)

    table = _table(results, workload["turns"])
    payload = {"workload": {**workload, "model": str(args.model), "tools": len(TOOLS)}, "results": results,
               "table": table, "bars": _bars(results, workload["turns"])}
    print(json.dumps(payload["bars"], indent=2))
    common.save_results("agent_loop", args.quick, setup.info, payload, _plot(results))


# -- one loop ------------------------------------------------------------------------------------
def _loop(http: httpx.Client, model: str, api: str, system: str, workload: dict) -> list[dict]:
    history: list[dict] = []  # neutral steps: {"user": text} | {"assistant": text, "calls": [...]} | {"results"}
    turns, next_user = [], 0
    for turn in range(workload["turns"]):
        if not history or "results" not in history[-1]:
            history.append({"user": USER_TURNS[next_user % len(USER_TURNS)]})
            next_user += 1
        started = time.perf_counter()
        probe = _post(http, api, _body(api, model, system, history, max_tokens=1))
        ttft = time.perf_counter() - started
        started = time.perf_counter()
        text, calls, first_delta, reply_usage = _stream(http, api, _body(api, model, system, history,
                                                                          workload["max_tokens"]), started)
        turns.append({"turn": turn + 1, "ttft_s": ttft, "first_delta_s": first_delta,
                      "reply_s": time.perf_counter() - started, **_usage(api, probe), "calls": len(calls),
                      "reply_cached_tokens": _usage(api, reply_usage)["cached_tokens"]})
        print(f"turn {turn + 1}: TTFT {ttft:.2f} s, prompt {turns[-1]['prompt_tokens']}, cached "
              f"{turns[-1]['cached_tokens']}, {len(calls)} call(s)", flush=True)
        history.append({"assistant": text, "calls": calls})
        if calls:
            history.append({"results": [(call["id"], TOOL_RESULT) for call in calls]})
    return turns


def _post(http: httpx.Client, api: str, body: dict) -> dict:
    response = http.post(_PATHS[api], json=body)
    response.raise_for_status()
    return response.json()["usage"]


_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def _stream(http: httpx.Client, api: str, body: dict, started: float) -> tuple[str, list[dict], float | None, dict]:
    """The streamed reply: its text, its calls ({"id", "name", "arguments"}), the time to its first
    visible delta, and its usage."""
    text, calls, first, usage = "", {}, None, {}
    body = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if api == "chat" else {})}
    with http.stream("POST", _PATHS[api], json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            piece, usage = _absorb(api, event, calls, usage)
            text += piece
            if first is None and (piece or calls):
                first = time.perf_counter() - started
    return text, [calls[k] for k in sorted(calls)], first, usage


def _absorb(api: str, event: dict, calls: dict, usage: dict) -> tuple[str, dict]:
    """One stream event's text, its call pieces merged into `calls`, and the usage so far."""
    if api == "chat":
        usage = event.get("usage") or usage
        piece = ""
        for choice in event.get("choices", []):
            delta = choice.get("delta", {})
            piece += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                function = call.get("function") or {}
                entry["name"] = function.get("name") or entry["name"]
                entry["arguments"] += function.get("arguments") or ""
        return piece, usage
    kind = event.get("type")
    if api == "messages":
        if kind == "message_start":
            usage = event["message"]["usage"]
        elif kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
            block = event["content_block"]
            calls[event["index"]] = {"id": block["id"], "name": block["name"], "arguments": ""}
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "input_json_delta":
                calls[event["index"]]["arguments"] += delta["partial_json"]
            elif delta["type"] == "text_delta":
                return delta["text"], usage
        return "", usage
    if kind == "response.output_item.added" and event["item"]["type"] == "function_call":
        item = event["item"]
        calls[event["output_index"]] = {"id": item["call_id"], "name": item["name"], "arguments": ""}
    elif kind == "response.function_call_arguments.delta":
        calls[event["output_index"]]["arguments"] += event["delta"]
    elif kind == "response.output_text.delta":
        return event["delta"], usage
    elif kind in ("response.completed", "response.incomplete"):
        usage = event["response"]["usage"]
    return "", usage


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


# -- each API's request for the same history -----------------------------------------------------
def _body(api: str, model: str, system: str, history: list[dict], max_tokens: int) -> dict:
    if api == "messages":
        return {"model": model, "system": system, "messages": _anthropic_messages(history), "max_tokens": max_tokens,
                "temperature": 0, "tools": [{"name": t["name"], "description": t["description"],
                                             "input_schema": t["parameters"]} for t in TOOLS]}
    if api == "responses":
        return {"model": model, "instructions": system, "input": _responses_input(history), "store": False,
                "max_output_tokens": max_tokens, "temperature": 0,
                "tools": [{"type": "function", **t} for t in TOOLS]}
    return {"model": model, "messages": [{"role": "system", "content": system}, *_chat_messages(history)],
            "max_tokens": max_tokens, "temperature": 0,
            "tools": [{"type": "function", "function": t} for t in TOOLS]}


def _chat_messages(history: list[dict]) -> list[dict]:
    messages = []
    for step in history:
        if "user" in step:
            messages.append({"role": "user", "content": step["user"]})
        elif "assistant" in step:
            message = {"role": "assistant", "content": step["assistant"]}
            if step["calls"]:
                message["tool_calls"] = [{"id": c["id"], "type": "function",
                                          "function": {"name": c["name"], "arguments": c["arguments"]}}
                                         for c in step["calls"]]
            messages.append(message)
        else:
            messages += [{"role": "tool", "tool_call_id": call_id, "content": result}
                         for call_id, result in step["results"]]
    return messages


def _anthropic_messages(history: list[dict]) -> list[dict]:
    messages = []
    for step in history:
        if "user" in step:
            messages.append({"role": "user", "content": step["user"]})
        elif "assistant" in step:
            blocks = [{"type": "text", "text": step["assistant"]}] if step["assistant"] else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": json.loads(c["arguments"])}
                       for c in step["calls"]]
            messages.append({"role": "assistant", "content": blocks})
        else:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call_id, "content": result}
                for call_id, result in step["results"]]})
    return messages


def _responses_input(history: list[dict]) -> list[dict]:
    items = []
    for step in history:
        if "user" in step:
            items.append({"role": "user", "content": step["user"]})
        elif "assistant" in step:
            if step["assistant"]:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": step["assistant"]}]})
            items += [{"type": "function_call", "call_id": c["id"], "name": c["name"], "arguments": c["arguments"]}
                      for c in step["calls"]]
        else:
            items += [{"type": "function_call_output", "call_id": call_id, "output": result}
                      for call_id, result in step["results"]]
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
        ttft_ax.plot(turns, [t["ttft_s"] for t in loop], style, marker="o", label=name)
        cache_ax.plot(turns, [t["cached_tokens"] / max(1, t["prompt_tokens"]) for t in loop], style, marker="o",
                      label=name)
    ttft_ax.set(xlabel="turn", ylabel="TTFT (s, log)", yscale="log", title="Time to first token per turn")
    cache_ax.set(xlabel="turn", ylabel="share of the prompt from cache", ylim=(0, 1.05),
                 title="Prompt tokens served from cache")
    for ax in (ttft_ax, cache_ax):
        ax.grid(alpha=0.3)
        ax.set_xticks(np.arange(1, len(next(iter(results.values()))) + 1))
    ttft_ax.legend()
    return fig


if __name__ == "__main__":
    main()
