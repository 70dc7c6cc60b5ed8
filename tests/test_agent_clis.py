"""The agent CLIs people run, unmodified at their pinned versions, end to end against tinymlx's server:
Claude Code (Messages), Codex CLI (Responses), opencode and aider (chat/completions). Each runs two
turns non-interactively (the second continues the first's session) as scripts/agent_clis.py sets them
up, the way the README's agent section says. scripts/test installs them once per machine.

Asserted: every request each CLI made was answered 200, each run exits 0 without an API error, and
every turn after the first of Claude Code and Codex, which re-send their whole system prompt and tool
list (8-12k tokens), was served at least 90% from the prefix cache, as each API's usage reports it.

The model is the tiny one behind the real Qwen2.5 tokenizer and chat template, with a 32k context as
the real one's, made terse (tiny_models.terse_qwen_engine): its replies are a few words long, so a
turn takes seconds, while every prompt goes through the real template, prefill and cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from server_harness import Exchange, RunningServer
from tiny_models import terse_qwen_engine

from tinymlx.server import ServerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import agent_clis  # noqa: E402

MODEL = "qwen2.5-coder-0.5b-instruct"
SMALL_MODEL = "qwen2.5-coder-0.5b-instruct-fast"  # Claude Code's model for side requests: an alias
MAIN_PATHS = {"claude": "/v1/messages", "codex": "/v1/responses"}


@pytest.fixture(scope="module")
def clis() -> dict[str, Path]:
    return agent_clis.install(log=lambda line: print(line, file=sys.stderr))


@pytest.fixture(scope="module")
def server(default_model_dir):
    # The default pool: two whole contexts (EngineConfig.kv_cache_bytes None).
    engine = terse_qwen_engine(default_model_dir, max_position_embeddings=32768, num_pages=None)
    running = RunningServer(engine, ServerConfig(served_model_names=(MODEL, SMALL_MODEL)), record=True)
    yield running
    running.close()


def sse_data(exchange: Exchange) -> list[dict]:
    text = exchange.body.decode()
    if not text.lstrip().startswith(("event:", "data:")):
        return [json.loads(text)]
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def prompt_usage(exchange: Exchange) -> tuple[int, int]:
    """(prompt tokens, of which served from the prefix cache) as the API's own usage reports them."""
    for data in sse_data(exchange):
        usage = (data.get("message") or {}).get("usage") if data.get("type") == "message_start" else \
            (data.get("response") or {}).get("usage") if data.get("type", "").startswith("response.") else None
        if exchange.path == "/v1/messages" and usage:
            cached = usage["cache_read_input_tokens"]
            return usage["input_tokens"] + cached + usage["cache_creation_input_tokens"], cached
        if exchange.path == "/v1/responses" and usage:
            return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    raise AssertionError(f"no usage in the reply to {exchange.path}: {exchange.body[:300]!r}")


@pytest.mark.parametrize("name", list(agent_clis.PINS))
def test_an_agent_cli_runs_two_turns_against_the_server(name, clis, server, default_model_dir, tmp_path):
    runner = agent_clis.AgentCLIs(server.base_url, MODEL, tmp_path / "home", small_model=SMALL_MODEL)
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "hello.txt").write_text("hello\n")
    flags = ("--no-git",) if name == "aider" else ()
    first_request = len(server.recorder.exchanges)
    runs = [runner.run(name, "Say hi.", workdir, flags=flags, timeout_s=300),
            runner.run(name, "Say it again.", workdir, resume=True, flags=flags, timeout_s=300)]
    exchanges = server.recorder.exchanges[first_request:]
    for run in runs:
        output = run.stdout + run.stderr
        assert run.returncode == 0, output[-3000:]
        assert "API Error" not in output and "APIError" not in output, output[-3000:]
    if name == "claude":
        assert not any(json.loads(run.stdout)["is_error"] for run in runs)
    assert exchanges, f"{name} sent nothing to the server"
    assert [(e.method, e.path, e.status) for e in exchanges if e.status != 200] == []
    if name in MAIN_PATHS:
        usages = [prompt_usage(e) for e in exchanges if e.path == MAIN_PATHS[name]]
        assert len(usages) >= 2 and usages[0][0] > 5000  # the whole system prompt and tools, re-sent each turn
        for prompt, cached in usages[1:]:
            assert cached >= 0.9 * prompt, (name, usages)
    server.wait_idle(30)


def test_the_readme_shows_the_line_each_cli_is_run_with():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name in agent_clis.PINS:
        assert agent_clis.readme_line(name, "http://127.0.0.1:8321", "qwen2.5-coder-1.5b-instruct") in readme


def test_side_requests_to_the_small_model_do_not_evict_the_conversation(server):
    """Claude Code sends side requests (titles, summaries) to its small model on the same server: under
    the default pool, a burst of them leaves the main conversation's prefix cached for its next turn."""
    fixture = Path(__file__).parent / "fixtures" / "agent_cli_requests" / "claude-code" / "01-v1_messages.json"
    first = {**json.loads(fixture.read_text())["body"], "model": MODEL, "stream": False}

    def post(body: dict) -> dict:
        response = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    reply = post(first)
    for i in range(6):  # each a prompt of its own, about 2k tokens, asking for 32000 tokens as Claude Code does
        topic = f"Summarize session {i}: " + " ".join(f"step {i}.{j} edited file_{j}.py" for j in range(300))
        post({"model": SMALL_MODEL, "max_tokens": 32000, "messages": [{"role": "user", "content": topic}]})
    second = {**first, "messages": [*first["messages"], {"role": "assistant", "content": reply["content"]},
                                    {"role": "user", "content": "And now?"}]}
    usage = post(second)["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert usage["cache_read_input_tokens"] >= 0.9 * prompt, usage
    server.wait_idle(30)
