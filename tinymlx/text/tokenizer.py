"""Tokenizer: text <-> token ids, the chat template, and which ids end generation.

Built on the `tokenizers` library and jinja2 only: the engine never imports transformers.
`gguf_tokenizer_files` rebuilds a Hugging Face tokenizer from a GGUF file's metadata.

Control-token text (`<|im_end|>`, `<|endoftext|>`: the tokenizer's special tokens) means two things:
- in a plain text prompt it is parsed as the control token, as Hugging Face, vLLM and mlx-lm do: whoever
  writes a raw prompt writes its template markup too;
- inside chat messages (and the template's other inputs, such as tools) it is plain text: only the
  template's own markup becomes control tokens, so a user who types `<|im_end|>` cannot end their turn
  early or forge another role's turn. The model's other added tokens (`<tool_call>`, `<think>`) keep their
  single ids there, so an assistant turn sent back encodes as the model wrote it.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import tokenizers
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ):
        self._backend = backend
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._chat_template = _compile_template(chat_template) if chat_template else None
        self._chat_template_source = chat_template or ""
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        bos = self._special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos else None
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self._control_ids = {
            token.content: token_id
            for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        }
        # Longest first, so a control token that starts another never cuts it short.
        names = sorted(self._control_ids, key=len, reverse=True)
        self._control_text = re.compile("|".join(map(re.escape, names))) if names else None
        self._encoding_lock = threading.Lock()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: tinymlx needs the fast-tokenizer file")
        backend = tokenizers.Tokenizer.from_file(str(path))
        config = {
            **_read_json(model_dir / "special_tokens_map.json"),
            **_read_json(model_dir / "tokenizer_config.json"),
        }
        template = config.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():  # newer checkpoints keep the template on its own
            template = (model_dir / "chat_template.jinja").read_text()
        elif isinstance(template, list):  # older ones list named templates
            template = {t["name"]: t["template"] for t in template}.get("default")
        special = {key: _content(config.get(key)) for key in _SPECIAL_KEYS}
        eos_ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            ids = _read_json(model_dir / name).get("eos_token_id")
            eos_ids.update(ids if isinstance(ids, list) else [] if ids is None else [ids])
        if special["eos_token"] and backend.token_to_id(special["eos_token"]) is not None:
            eos_ids.add(backend.token_to_id(special["eos_token"]))
        return cls(backend, template, special, eos_ids)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance builds its token trie from)."""
        return self._backend.to_str()

    def has_same_vocabulary(self, other: Tokenizer) -> bool:
        """Every token maps to the same id (what a draft model must share with its target)."""
        return self._backend.get_vocab(with_added_tokens=True) == other._backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._encoding_lock:  # apply_chat_template switches how the backend treats control-token text
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        """False for base models, whose files carry no template: they continue plain text."""
        return self._chat_template is not None

    @property
    def chat_template_source(self) -> str:
        """The template's Jinja text ("" without one): the server reads its tool-call syntax from it."""
        return self._chat_template_source

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The prompt text for `messages`; extra keyword arguments (tools, ...) reach the template."""
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send a plain text prompt instead")
        variables = {**self._special_tokens, **template_kwargs}
        return self._chat_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
    ) -> list[int]:
        """The prompt's ids. Control-token text inside the messages stays text (see the module's docstring)."""
        if self._control_text is None:
            text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
            return self.encode(text, add_special_tokens=False)
        # Break the control-token text in every string the caller gave with a character found nowhere
        # else, render, and only the template's own control tokens are left whole to find.
        marker = _unused_character([messages, template_kwargs, self._chat_template_source])
        messages, template_kwargs = _map_strings((messages, template_kwargs), lambda s: self._break(s, marker))
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        pieces: list[str | int] = []  # text to encode as text, and the template's control-token ids
        position = 0
        for match in self._control_text.finditer(text):
            pieces += [text[position : match.start()].replace(marker, ""), self._control_ids[match.group()]]
            position = match.end()
        pieces.append(text[position:].replace(marker, ""))
        # The template writes any BOS itself, so encoding must not add another (as in transformers).
        with self._encoding_lock:
            self._backend.encode_special_tokens = True  # control-token text in these pieces is text
            try:
                ids: list[int] = []
                for piece in pieces:
                    ids += [piece] if isinstance(piece, int) else self._backend.encode(piece, add_special_tokens=False).ids
                return ids
            finally:
                self._backend.encode_special_tokens = False

    def _break(self, text: str, marker: str) -> str:
        return self._control_text.sub(lambda m: m.group()[0] + marker + m.group()[1:], text)


def _compile_template(source: str):
    """Compile the way transformers does, so templates written for it render identically."""

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _map_strings(value, fn):
    """`value` with `fn` applied to every string inside its dicts, lists and tuples (keys stay)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_strings(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(item, fn) for item in value)
    return value


def _strings(value) -> Iterator[str]:
    """Every string inside `value`'s dicts (values), lists and tuples."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (dict, list, tuple)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _strings(item)


def _unused_character(values) -> str:
    """A private-use character that occurs in none of the strings inside `values`."""
    seen = set().union(*_strings(values))
    return next(c for c in map(chr, range(0xE000, 0xF900)) if c not in seen)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


# ---- GGUF metadata -> tokenizer files ----------------------------------------------------------

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_SPLITS = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
}
# llama.cpp also ends generation on these when the file marks them as control tokens.
_END_OF_GENERATION = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Split text the way the vocabulary's merges were learned (llama.cpp's `tokenizer.ggml.pre`)."""
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre == "smollm":  # every digit on its own, then GPT-2's pattern, as SmolLM2's tokenizer.json does
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in ("default", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    supported = ", ".join([*_SPLITS, "smollm", "default", "gpt-2"])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {supported})")


def _byte_level_bpe(meta: dict, tokens: list[str]) -> tokenizers.Tokenizer:
    """llama.cpp's 'gpt2' vocabulary: byte-level BPE with the merges the file lists."""
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _gemma_sentencepiece(tokens: list[str]) -> tokenizers.Tokenizer:
    """Gemma's sentencepiece vocabulary ('llama' in llama.cpp's terms) as transformers' GemmaTokenizer
    builds it: BPE with byte fallback over text whose spaces became U+2581, no prefix space.

    The file lists no merges, so they are rebuilt from the vocabulary: every split of a token into two
    tokens, best first. Gemma's scores do not follow its merge order; the order of the tokens does.
    Tokens of two or more spaces are stored with real spaces; their U+2581 spelling is what BPE meets.
    (As transformers' gguf_tokenizer_mapping.gemma_tokenizer does, so both encode alike.)
    """
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(
        models.BPE(vocab, _merges_in_token_order(vocab), unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _merges_in_token_order(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Each token's splits into two vocabulary tokens; earlier tokens' merges first, and within a token
    the longer left part first (transformers' generate_merges with the token order as its scores)."""
    merges = []
    for token, index in vocab.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges += [(index, -len(left), -len(right), left, right) for left, right in pairs]
    merges.sort(key=lambda merge: merge[:3])  # stable, so equal keys keep the order above
    return [(left, right) for *_, left, right in merges]


def gguf_tokenizer_files(meta: dict) -> tuple[tokenizers.Tokenizer, dict, dict]:
    """(tokenizer.json, tokenizer_config.json, generation_config.json) for a GGUF's vocabulary:
    byte-level BPE ('gpt2'), or Gemma's sentencepiece ('llama' in a gemma* architecture; Gemma 4's files call
    theirs 'gemma4', listing the merges this rebuilds from the vocabulary as for Gemma 3)."""
    kind, arch = meta.get("tokenizer.ggml.model"), str(meta.get("general.architecture", ""))
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
        user_defined = [t for t, k in zip(tokens, types) if k == _USER_DEFINED]
    elif kind in ("llama", "gemma4") and arch.startswith("gemma"):  # gemma4: Gemma 4's, the same kind of vocabulary
        backend = _gemma_sentencepiece(tokens)
        vocab = backend.get_vocab()  # a run of spaces was respelled: its added token would never match
        user_defined = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported for {arch!r} "
                         "(supported: byte-level BPE 'gpt2'; sentencepiece 'llama' for gemma3, 'gemma4' for gemma4)")
    # Control tokens (<|im_start|>) are special; user-defined ones (<tool_call>) are matched whole but kept on decode.
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, bos_id = token("bos_token_id"), meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    eos_ids = {
        meta[f"tokenizer.ggml.{key}"]
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if f"tokenizer.ggml.{key}" in meta
    }
    eos_ids |= {i for i, (t, k) in enumerate(zip(tokens, types)) if k == _CONTROL and t in _END_OF_GENERATION}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "bos_token": bos,
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": sorted(eos_ids),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return backend, tokenizer_config, generation_config
