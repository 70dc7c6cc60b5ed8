"""Tiny random models and a byte tokenizer: fast stand-ins for engine and scheduler tests."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
from dense_attention import DenseAttention

from tinymlx import SamplingParams
from tinymlx.core.batch import ScheduledBatch, ScheduledChunk, StateAccess
from tinymlx.core.config import EngineConfig
from tinymlx.core.images import PromptImages
from tinymlx.core.layer_specs import attending_spec, kv_source, page_groups
from tinymlx.core.outputs import RequestOutput
from tinymlx.engine.engine import Engine
from tinymlx.kv.state_slots import ZERO_SLOT
from tinymlx.models import BaseModelArgs, CausalLM, SlidingWindow, args_from_config, build_model
from tinymlx.runner.model_runner import ModelRunner
from tinymlx.text.tokenizer import Tokenizer


def tiny_args(model_type: str = "qwen2", vocab_size: int = 300, **overrides) -> BaseModelArgs:
    """A tiny model's arguments from a config.json dict (`overrides` are config keys)."""
    values = dict(
        model_type=model_type, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size, head_dim=16,
        rope_theta=10000.0, max_position_embeddings=1024,
    )
    values.update(overrides)
    return args_from_config(values)


def tiny_model(seed: int = 0, std: float = 0.3, **overrides) -> CausalLM:
    """A random model whose weights are large enough that attention patterns actually matter."""
    model = build_model(tiny_args(**overrides))
    rng = np.random.default_rng(seed)
    params = [(name, mx.array(rng.normal(0, std, p.shape).astype(np.float32)))
              for name, p in _flatten(model.parameters())]
    model.load_weights(params)
    mx.eval(model.parameters())
    return model


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    """A transformers model's logits at every position of one sequence (torch imported by the caller's test)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def max_diff(a, b) -> float:
    return float(np.abs(np.array(a) - np.array(b)).max())


def dense_logits(model: CausalLM, token_ids: list[int]) -> mx.array:
    """Reference: logits at every position of one sequence, plain causal attention (each layer's window), no cache."""
    n = len(token_ids)
    specs = model.layer_specs()
    windows = [spec.window if isinstance(spec := attending_spec(specs, layer), SlidingWindow) else None
               for layer in range(len(specs))]
    sources = {layer: kv_source(specs, layer) for layer in range(len(specs)) if kv_source(specs, layer) != layer}
    hidden = model(mx.array(token_ids), mx.arange(n), DenseAttention(1, n, windows, sources))
    return model.logits(hidden)


def paged_logits(model: CausalLM, token_ids: list[int], prompt_len: int, block_size: int,
                 chunk_size: int | None = None, seed: int = 0, query_tile: int = 64,
                 kv_cache_dtype: str = "auto", images: PromptImages | None = None) -> list[mx.array]:
    """Logits for positions prompt_len-1 .. n-1: chunked prefill, then teacher-forced decode steps.
    `images`: the prompt's (a vision-language model's), which every chunk carries.

    The block table is a random permutation, so contiguity can't hide an addressing bug.
    """
    n = len(token_ids)
    num_pages = -(-n // block_size)  # each page group's (each run of a KV group's layers: block_pool.py)
    num_groups = len(page_groups(model.layer_specs()))
    config = EngineConfig(block_size=block_size, num_pages=num_groups * num_pages + 3, kv_cache_dtype=kv_cache_dtype)
    config = config.resolve(model.args, mx.float32, model.layer_specs())
    runner = ModelRunner(model, config, query_tile=query_tile)
    pages = np.random.default_rng(seed).permutation(config.num_pages)[:num_groups * num_pages].tolist()
    tables = tuple(tuple(pages[g * num_pages:(g + 1) * num_pages]) for g in range(num_groups))
    chunk_size = chunk_size or prompt_len
    results, start = [], 0
    while start < n:
        end = min(start + chunk_size, prompt_len) if start < prompt_len else start + 1
        # A recurrent model's state: from the zero slot, then in live slot 1 (see StateSlots).
        state = StateAccess(ZERO_SLOT if start == 0 else 1, 1) if runner.state_pools else None
        chunk = ScheduledChunk(0, token_ids[start:end], start, tables, end >= prompt_len, state=state, images=images)
        logits = runner.run(ScheduledBatch([chunk], end - start, []))
        if chunk.needs_sample:
            results.append(logits[0])
        start = end
    return results


def allocate(kv_coordinator, seq, first_chunk_tokens: int | None = None) -> bool:
    """The scheduler's admission: blocks from the KV coordinator, the tokens its cache serves counted computed."""
    num_cached = kv_coordinator.allocate(seq, first_chunk_tokens)
    if num_cached is not None:
        seq.num_computed_tokens = num_cached
    return num_cached is not None


def save_dir(path: Path, model: CausalLM, extra_config=None, drop=()) -> Path:
    """A Hugging Face-format directory (config.json + safetensors) holding `model`."""
    config = dataclasses.asdict(model.args)
    config.update(extra_config or {})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    weights = {k: v for k, v in _flatten(model.parameters()) if k not in drop}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def byte_tokenizer_backend():
    """A `tokenizers` tokenizer encoding as ByteTokenizer does: byte b is token b, EOS is 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's printable stand-ins for the 256 bytes, which ByteLevel pre-tokenization produces.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    char_of = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab={char_of[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer


def save_byte_tokenizer(path: Path) -> Path:
    """tokenizer.json + tokenizer_config.json of ByteTokenizer, so a tiny model directory loads
    through LLM, the CLI and Engine.from_config."""
    byte_tokenizer_backend().save(str(path / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": template}))
    return path


def run_to_completion(engine, arrivals: dict[int, list[tuple]]) -> dict[str, list[int]]:
    """Feed requests at their arrival steps; check integrity after every step; return final token ids."""
    return {request_id: output.token_ids for request_id, output in run_outputs(engine, arrivals).items()}


def run_outputs(engine, arrivals: dict[int, list[tuple]]) -> dict[str, RequestOutput]:
    """Like run_to_completion, returning each request's final output (its logprobs too)."""
    finals, step_no = {}, 0
    while arrivals or engine.has_unfinished_requests:
        for prompt, params, request_id in arrivals.pop(step_no, []):
            engine.add_request(prompt, params, request_id=request_id)
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finals, "a request finished twice"
                finals[output.request_id] = output
        engine.check()
        step_no += 1
    assert engine.kv_coordinator.num_used_pages == 0
    return finals


def random_workload(n: int, seed: int = 0, max_arrival: int = 12, seeded_sampling: bool = False):
    """Random prompts, lengths and arrival steps; greedy, or with `seeded_sampling` every other request
    samples at temperature 0.8 with its own seed."""
    rng = np.random.default_rng(seed)
    arrivals: dict[int, list[tuple]] = {}
    for i in range(n):
        prompt = rng.integers(0, 256, int(rng.integers(3, 70))).tolist()
        temperature, request_seed = (0.8, i) if seeded_sampling and i % 2 else (0.0, None)
        params = SamplingParams(temperature=temperature, seed=request_seed, max_tokens=int(rng.integers(1, 24)),
                                ignore_eos=True)
        arrivals.setdefault(int(rng.integers(0, max_arrival)), []).append((prompt, params, f"r{i}"))
    return arrivals


class ByteTokenizer:
    """Bytes are tokens 0-255; 256 is EOS. Enough for engine tests on tiny models."""

    eos_token_ids = frozenset({256})
    bos_token_id = None
    vocab_size = 300
    has_chat_template = True
    chat_template_source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def to_json(self) -> str:
        return byte_tokenizer_backend().to_str()


def tiny_engine(seed: int = 0, **config) -> Engine:
    config.setdefault("block_size", 4)
    config.setdefault("num_pages", 256)
    return Engine(tiny_model(seed), ByteTokenizer(), EngineConfig(**config), model_name="tiny-qwen2")


def tiny_qwen_engine(tokenizer_dir: Path, seed: int = 0, max_position_embeddings: int = 8192,
                     shape: Callable[[CausalLM, Tokenizer], None] | None = None, **config) -> Engine:
    """The tiny model behind the real Qwen2.5 tokenizer and chat template (tools, <tool_call> tokens):
    its text is noise, but every prompt, template and grammar path is the real one. `shape` may
    rewrite its weights before the engine takes it."""
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    vocab_size = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config.setdefault("block_size", 16)
    config.setdefault("num_pages", 512)
    config.setdefault("max_num_batched_tokens", 512)
    model = tiny_model(seed, std=0.05, vocab_size=vocab_size, max_position_embeddings=max_position_embeddings)
    if shape is not None:
        shape(model, tokenizer)
    return Engine(model, tokenizer, EngineConfig(**config), model_name="tiny-qwen2-tools")


def terse_qwen_engine(tokenizer_dir: Path, words: tuple[str, ...] = (" Hi", " there", ".", " Done"),
                      **config) -> Engine:
    """tiny_qwen_engine whose next token hardly depends on the context: one of a few words, or the end
    of the turn, the likeliest (what greedy decoding picks; about 1 in 3 when sampling) except right
    after a newline, where the generation prompt ends: so a reply is a few words, never empty and never
    a call. Agent CLIs run their turns in seconds against it, while every prompt still goes through the
    real tokenizer, template, prefill and prefix cache.

    How: the final norm keeps two residual coordinates. Every token embeds a large value in the first,
    "\n" alone in the second; the logits are lm_head's columns for them, written here."""
    def shape(model: CausalLM, tokenizer: Tokenizer) -> None:
        def token(text: str) -> int:
            return tokenizer.encode(text, add_special_tokens=False)[0]

        embed = np.array(model.model.embed_tokens.weight)
        embed[:, :2] = 0.0
        embed[:, 0] = 8.0
        embed[token("\n"), 1] = 8.0
        lm_head = np.zeros(model.lm_head.weight.shape, np.float32)
        lm_head[:, 0] = -4.0  # x 8: every other token is e^-32 as likely
        for word in words:
            lm_head[token(word), 0] = 0.0
        lm_head[token("<|im_end|>"), :2] = (0.5 / 8, -1.0)  # after "\n": e^-5 as likely as a word
        norm = np.zeros(model.model.norm.weight.shape, np.float32)
        norm[:2] = 1.0
        model.load_weights([("model.embed_tokens.weight", mx.array(embed)), ("lm_head.weight", mx.array(lm_head)),
                            ("model.norm.weight", mx.array(norm))], strict=False)
        mx.eval(model.parameters())

    return tiny_qwen_engine(tokenizer_dir, shape=shape, **config)
