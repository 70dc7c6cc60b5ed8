"""The real models against Hugging Face transformers, both loading the very same GGUF file.

Qwen2.5-Coder-0.5B (qwen2) and SmolLM2-135M (llama): logits at prefill and at 32 teacher-forced
decode steps through the paged cache, and greedy generation of a chat reply.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import paged_logits

from tinymlx import LLM, SamplingParams
from tinymlx.models import load_model
from tinymlx.text.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 5e-3
DECODE_STEPS = 32
MESSAGES = [
    {"role": "system", "content": "You are a helpful coding assistant."},
    {"role": "user", "content": "Write a Python function that checks whether a number is prime."},
]


def hf_model(gguf):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
    )
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def check_logit_parity(gguf, model_dir, block_size: int) -> float:
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES)
    reference_model = hf_model(gguf)
    continuation = hf_greedy(reference_model, prompt, DECODE_STEPS)
    tokens = prompt + continuation
    with torch.no_grad():
        reference = reference_model(torch.tensor([tokens])).logits[0].numpy()
    del reference_model
    gc.collect()

    model = load_model(model_dir, dtype="float32")
    ours = paged_logits(model, tokens, prompt_len=len(prompt), block_size=block_size, chunk_size=13)
    assert len(ours) == DECODE_STEPS + 1
    diffs = [float(np.abs(np.array(logits) - reference[len(prompt) - 1 + i]).max()) for i, logits in enumerate(ours)]
    print(f"\n{model_dir.name}: max |logit diff| prefill {diffs[0]:.2e}, decode max {max(diffs[1:]):.2e}")
    assert max(diffs) < ATOL, diffs
    return max(diffs)


def test_qwen2_logits_match_hugging_face(default_gguf, default_model_dir):
    check_logit_parity(default_gguf, default_model_dir, block_size=16)


def test_llama_logits_match_hugging_face(smollm_gguf, smollm_model_dir):
    check_logit_parity(smollm_gguf, smollm_model_dir, block_size=4)


def test_greedy_chat_reply_matches_hugging_face(default_gguf, default_model_dir):
    tokenizer = Tokenizer.from_dir(default_model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES)
    expected = hf_greedy(hf_model(default_gguf), prompt, 48)
    gc.collect()
    llm = LLM(str(default_model_dir), dtype="float32", num_pages=256, progress=False)
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=48))[0]
    assert out.token_ids == expected[: len(out.token_ids)]
    assert len(out.token_ids) == 48 or out.finish_reason == "stop"
    assert "def " in out.text and "prime" in out.text.lower()
    mx.clear_cache()
