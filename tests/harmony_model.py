"""A tiny gpt-oss model directory that speaks harmony: a transformers-written random checkpoint, a byte-level
tokenizer with harmony's control tokens, a harmony chat template (written here, in the shape of gpt-oss's:
system and developer messages, channels, calls to `functions.NAME`, tool results) and harmony's end tokens.

Its text is noise, so a test scripts the reply: `scripted(engine, grammar)` samples every request under a
Lark grammar of the reply instead of the one the server asked for (which it keeps, to be checked), and
`as_grammar` writes the grammar whose one sentence is a reply. test_gemma4_chat.py scripts its model so too."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import transformers
from tiny_models import byte_tokenizer_backend

from tinymlx import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.models import load_model
from tinymlx.text.tokenizer import Tokenizer

CONTROL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

TEMPLATE = """<|start|>system<|message|>You are a tiny model.
Reasoning: {{ reasoning_effort | default("medium") }}

# Valid channels: analysis, commentary, final.
{% if tools %}Calls to these tools must go to the commentary channel: 'functions'.
{% endif %}<|end|>
{% set rest = messages %}
{% if messages[0].role in ("system", "developer") %}{% set rest = messages[1:] %}{% endif %}
{% if messages[0].role in ("system", "developer") or tools %}<|start|>developer<|message|>
{% if messages[0].role in ("system", "developer") %}# Instructions

{{ messages[0].content }}

{% endif %}
{% if tools %}# Tools

namespace functions {
{% for tool in tools %}// {{ tool.function.description }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions
{% endif %}<|end|>
{% endif %}
{% for message in rest %}
{% if message.role == "user" %}<|start|>user<|message|>{{ message.content }}<|end|>
{% elif message.role == "assistant" and message.tool_calls %}
{% if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>{% endif %}
{% for call in message.tool_calls %}<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary json\
<|message|>{{ call.function.arguments | tojson }}<|call|>{% endfor %}
{% elif message.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{% elif message.role == "tool" %}<|start|>functions.{{ message.name }} to=assistant<|channel|>commentary<|message|>\
{{ message.content | tojson }}<|end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|start|>assistant{% endif %}"""


def harmony_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = transformers.GptOssConfig(
        vocab_size=300, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
        max_position_embeddings=4096, rms_norm_eps=1e-5)
    transformers.GptOssForCausalLM(config).save_pretrained(path)
    backend = byte_tokenizer_backend()
    backend.add_special_tokens(list(CONTROL))
    backend.save(str(path / "tokenizer.json"))
    ends = [backend.token_to_id(token) for token in ("<|return|>", "<|call|>", "<eos>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    return path


def harmony_engine(model_dir: Path) -> Engine:
    return Engine(load_model(model_dir, dtype="float32"), Tokenizer.from_dir(model_dir),
                  EngineConfig(block_size=16, num_pages=256, max_num_batched_tokens=512), model_name="tiny-gpt-oss")


def scripted(engine: Engine, grammar: str) -> list:
    """Every request from now on writes a sentence of `grammar` (Lark, harmony's markup as its tokens);
    returns the list that collects the parameters each request came with."""
    asked = []
    validate = engine.__dict__.setdefault("unscripted_validate", engine.validate)  # a second script replaces the first

    def validate_scripted(token_ids, params, images=None):
        asked.append(params)
        return validate(token_ids, dataclasses.replace(params, grammar=grammar), images)

    engine.validate = validate_scripted
    return asked


def as_grammar(reply: str, markup: tuple[str, ...] = CONTROL) -> str:
    """A Lark grammar whose one sentence is `reply`, its `markup` as the control tokens (the prompt's own
    `<|start|>assistant`, which harmony's replies are written with here, left out)."""
    pieces = re.split("(" + "|".join(map(re.escape, markup)) + ")", reply.removeprefix("<|start|>assistant"))
    return "start: " + " ".join(p if p in markup else json.dumps(p) for p in pieces if p) + "\n"


def accepts(tokenizer: Tokenizer, grammar: str, reply: str) -> bool:
    """Whether `grammar` lets a model write `reply` (its markup as the control tokens) and end there."""
    import llguidance

    ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size,
                                          eos_token=sorted(tokenizer.eos_token_ids))
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = tokenizer.encode(reply.removeprefix("<|start|>assistant"), add_special_tokens=False)
    return all(matcher.consume_token(token) for token in tokens) and matcher.is_accepting()
