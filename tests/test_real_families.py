"""The newer offline models against Hugging Face transformers, in float32.

Gemma 3 270M (gemma3: 15 of its 18 layers attend over a 512-token window), the reference loaded by
transformers from the very same GGUF file: the converted weights and tokenizer equal transformers'
own, and greedy tokens (and their logprobs) through the engine's public API equal transformers' on
prompts longer than the window.

Qwen2.5-Coder-1.5B (qwen2): greedy chat replies equal transformers'. Its reference loads the directory
tinymlx converted the GGUF to (transformers' own GGUF load takes minutes on two cores); that qwen2
conversion equals transformers' GGUF load exactly is test_loader's check on the 0.5B, same quant types.
"""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import safetensors.numpy

from tinymlx import LLM, SamplingParams
from tinymlx.loader import convert_gguf, fetch_model, load_config
from tinymlx.text.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GEMMA, QWEN_1_5B = "gemma-3-270m", "qwen2.5-coder-1.5b-instruct"
WINDOW = 512
LOGPROB_ATOL = 2e-3  # measured: 1.5e-4; a full-attention model instead misses by > 1
CHATS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "What does the `yield` keyword do in Python? One sentence."}],
]


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    return fetch_model(GEMMA, progress=False)


@pytest.fixture(scope="module")
def gemma_dir(gemma_gguf: Path) -> Path:
    return convert_gguf(gemma_gguf, progress=False)


@pytest.fixture(scope="module")
def gemma_reference(gemma_gguf: Path):
    """transformers' own load of the GGUF (it parses the file's 262k-token metadata twice: ~1 min), shared."""
    model = hf_from_gguf(gemma_gguf)
    yield model
    del model
    gc.collect()


def hf_from_gguf(gguf: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    return model.eval()


def long_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """Two prompts of about 1.6 and 2.1 windows: a table to continue, and a module of small functions."""
    cities = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Seoul", "Perth", "Turin", "Hanoi", "Dakar"]
    rows = [f"{i},{cities[i % 10]},{(i * 37) % 101},{'yes' if i % 3 else 'no'}" for i in range(1, 81)]
    table = "id,city,score,active\n" + "\n".join(rows) + "\n"
    functions = "".join(f"def scale_{i}(x):\n    \"\"\"Return x times {i}.\"\"\"\n    return x * {i}\n\n\n"
                        for i in range(1, 41))
    prompts = [tokenizer.encode(table), tokenizer.encode("# helpers.py\n\n\n" + functions)]
    assert all(len(p) > WINDOW for p in prompts), [len(p) for p in prompts]
    return prompts


def test_gemma3_weights_and_config_equal_transformers_gguf_load(gemma_reference, gemma_dir):
    expected = {name: t.numpy() for name, t in gemma_reference.state_dict().items()}
    ref_config = gemma_reference.config
    ours = safetensors.numpy.load_file(gemma_dir / "model.safetensors")
    expected.pop("lm_head.weight")  # tied to the embedding
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():  # exact: the same dequantization, and the norms' 1 taken off
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)
    config = load_config(gemma_dir)
    assert config["layer_types"] == list(ref_config.layer_types)
    for key in ("sliding_window", "head_dim", "query_pre_attn_scalar", "num_key_value_heads", "vocab_size"):
        assert config[key] == getattr(ref_config, key), key
    del expected, ours
    gc.collect()


def test_gemma3_tokenizer_equals_transformers_gguf_tokenizer(gemma_gguf, gemma_dir):
    reference = transformers.AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    ours = Tokenizer.from_dir(gemma_dir)
    texts = ["Hello world", "  two  spaces   three\t\ttabs", "def f(x):\n    return x\n\n\n", "naïve café 日本語 🤖",
             "<start_of_turn>user\nhi<end_of_turn>\n", " leading space", "CRLF\r\nline", "x" * 40,
             "1234567890 3.14159 -0.5e-3", "\u2581literal", "<unused5> <mask> <bos>", Path(__file__).read_text()]
    for text in texts:
        assert ours.encode(text) == reference.encode(text), text[:40]
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text), skip_special_tokens=True)
    assert ours.bos_token_id == 2 and {1, 106} <= ours.eos_token_ids  # <eos>, <end_of_turn>


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and each one's logprob (from the raw logits of its step)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1)[token].item() for step, token in zip(out.logits, tokens)]
    return tokens, np.array(logprobs)


def test_gemma3_greedy_past_the_window_equals_transformers(gemma_reference, gemma_dir):
    prompts = long_prompts(Tokenizer.from_dir(gemma_dir))
    expected = [hf_greedy(gemma_reference, prompt, 16) for prompt in prompts]

    llm = LLM(str(gemma_dir), dtype="float32", progress=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0))
    for out, (tokens, logprobs) in zip(outs, expected):
        assert out.token_ids[: len(tokens)] == tokens  # transformers stops at an EOS; ours ignores it
        ours = np.array([step.logprob for step in out.logprobs[: len(tokens)]])
        assert np.abs(ours - logprobs).max() < LOGPROB_ATOL, np.abs(ours - logprobs).max()
    del llm
    mx.clear_cache()


def test_qwen2_5_coder_1_5b_greedy_chat_equals_transformers():
    gguf = fetch_model(QWEN_1_5B, progress=False)
    model_dir = convert_gguf(gguf, progress=False)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [tokenizer.apply_chat_template(chat) for chat in CHATS]
    n = 16
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = [hf_greedy(reference, prompt, n)[0] for prompt in prompts]
    del reference
    gc.collect()

    llm = LLM(str(model_dir), dtype="float32", num_pages=64, progress=False)
    outs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=n))
    for out, tokens in zip(outs, expected):
        assert out.token_ids == tokens[: len(out.token_ids)]
        assert len(out.token_ids) == n or out.finish_reason == "stop"
    assert "def " in outs[0].text and "fib" in outs[0].text.lower()
    assert "generator" in outs[1].text.lower() or "yield" in outs[1].text.lower()
    del llm
    mx.clear_cache()


def test_the_real_draft_pair_decodes_greedily_exactly_as_the_target_alone():
    """Qwen2.5-Coder-1.5B drafted by the 0.5B (same vocabulary), both named as a user names them: the greedy
    replies to two chats equal plain decoding's. Drafting every step (adaptive=0), so the test cannot
    pass by the planner choosing not to draft."""
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(QWEN_1_5B, dtype="float32", num_pages=64, progress=False)
    expected = [out.token_ids for out in plain.chat(CHATS, params)]
    del plain
    gc.collect()
    llm = LLM(QWEN_1_5B, dtype="float32", num_pages=64, speculative="draft:qwen2.5-coder-0.5b-instruct,adaptive=0",
              progress=False)
    assert [out.token_ids for out in llm.chat(CHATS, params)] == expected
    stats = llm.stats()
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.3, stats.acceptance_rate
    del llm
    mx.clear_cache()
