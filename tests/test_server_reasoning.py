"""Reasoning through `tinymlx serve`: <think>...</think> split off as reasoning_content, streamed and
not, and chat_template_kwargs reaching the template.

The tiny model sits behind the real Qwen2.5 tokenizer with a Qwen3-style thinking template; a regex
constraint makes it write a known reply, so the split is checked against exact text.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from server_harness import RunningServer
from tiny_models import tiny_qwen_engine

# Qwen3's shape: earlier turns' thinking is dropped, enable_thinking=false writes an empty think block.
# "opens" adds Qwen3.5's: the generation prompt itself opens <think>.
TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- elif opens %}<think>\n{%- endif %}{%- endif %}"
)
USER = [{"role": "user", "content": "Is 17 prime?"}]


def thinking_server(tmp_path, default_model_dir, opens: bool) -> RunningServer:
    model_dir = tmp_path / ("opens" if opens else "optional")
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(default_model_dir / name, model_dir / name)
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.replace("opens", "true" if opens else "false")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return RunningServer(tiny_qwen_engine(model_dir))


@pytest.mark.parametrize("opens", [False, True], ids=["model-opens-think", "prompt-opens-think"])
def test_thinking_is_split_off_streamed_and_not(tmp_path, default_model_dir, opens):
    server = thinking_server(tmp_path, default_model_dir, opens)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    reply = r"17 has no divisor but 1 and itself\.\n</think>\n\nYes, 17 is prime\."
    body = dict(model=server.model, messages=USER, max_tokens=60, temperature=0,
                extra_body={"guided_regex": reply if opens else r"<think>\n" + reply})
    try:
        message = client.chat.completions.create(**body).choices[0].message
        assert message.content == "Yes, 17 is prime."
        assert message.model_extra["reasoning_content"] == "17 has no divisor but 1 and itself."

        reasoning, content = "", ""
        for chunk in client.chat.completions.create(**body, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            reasoning += (delta.model_extra or {}).get("reasoning_content") or "" if delta else ""
            content += delta.content or "" if delta else ""
        assert (reasoning, content) == (message.model_extra["reasoning_content"], message.content)
        server.wait_idle()
    finally:
        server.close()


def test_chat_template_kwargs_reach_the_template(tmp_path, default_model_dir):
    server = thinking_server(tmp_path, default_model_dir, opens=True)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    try:
        def prompt_tokens(**kwargs) -> int:
            return client.chat.completions.create(model=server.model, messages=USER, max_tokens=1,
                                                  **kwargs).usage.prompt_tokens

        thinking = prompt_tokens()
        not_thinking = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        # "<think>\n" against "<think>\n\n</think>\n\n": the closed block is longer.
        assert not_thinking > thinking
        # Not thinking, the reply is all answer: no reasoning_content at all.
        message = client.chat.completions.create(
            model=server.model, messages=USER, max_tokens=20, temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}, "guided_regex": "No think here"}
        ).choices[0].message
        assert message.content == "No think here" and "reasoning_content" not in (message.model_extra or {})
        server.wait_idle()
    finally:
        server.close()
