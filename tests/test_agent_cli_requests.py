"""The requests the agent CLIs really sent (Claude Code, Codex, opencode, aider; tests/fixtures/agent_cli_requests/,
recorded by scripts/capture_agent_requests.py at the versions its README names), replayed as sent against
the server: each is answered 200, its stream complete. Only the output length is set, to 8 tokens: the tiny
model's noise would otherwise run to the context's end (the clamp itself is tested in each API's own file)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from server_harness import RunningServer
from tiny_models import tiny_qwen_engine

from tinymlx.server import ServerConfig

FIXTURES = Path(__file__).parent / "fixtures" / "agent_cli_requests"
SERVED = ("claude-code", "claude-code-tool-result", "codex", "codex-known-model", "codex-tool-result", "opencode",
          "opencode-tool-result", "aider", "aider-edit-commit")
REQUESTS = sorted(path for cli in SERVED for path in (FIXTURES / cli).glob("*.json"))
MODEL = "qwen2.5-coder-0.5b-instruct"  # what the CLIs were configured to ask for
# codex-known-model asked for a model Codex knows, so that it sends its whole tool set (apply_patch as a
# freeform tool): served under that name as an alias.
ALIAS = "gpt-5.5"
SENT_HEADERS = ("anthropic-version", "anthropic-beta", "content-type", "user-agent")


@pytest.fixture(scope="module")
def server(default_model_dir):
    """A 32k context, as the real model's: Claude Code's first prompt alone is 11.6k tokens."""
    engine = tiny_qwen_engine(default_model_dir, max_position_embeddings=32768, num_pages=2304)
    running = RunningServer(engine, ServerConfig(served_model_names=(MODEL, ALIAS)))
    yield running
    running.close()


@pytest.mark.parametrize("path", REQUESTS, ids=[f"{p.parent.name}/{p.stem}" for p in REQUESTS])
def test_a_request_a_cli_sent_is_served(server, path):
    request = json.loads(path.read_text())
    body = dict(request["body"])
    assert body["model"] in (MODEL, ALIAS)
    # aider sends none: its reply would run to the context's end
    body["max_output_tokens" if request["path"] == "/v1/responses" else "max_tokens"] = 8
    headers = {name: value for name, value in request["headers"].items() if name in SENT_HEADERS}
    with httpx.stream(request["method"], server.base_url + request["path"], params=request["query"], json=body,
                      headers=headers, timeout=120) as response:
        text = response.read().decode()
    assert response.status_code == 200, text
    if body.get("stream"):
        ends = {"/v1/messages": "event: message_stop", "/v1/responses": "event: response.incomplete"}
        assert ends[request["path"]] in text if request["path"] in ends else text.rstrip().endswith("[DONE]")
    else:
        assert json.loads(text)["choices"][0]["message"]["role"] == "assistant"
    server.wait_idle(30)
