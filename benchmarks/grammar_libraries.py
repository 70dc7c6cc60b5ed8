"""Constrained-decoding libraries: the time to compute the allowed-token mask, per token, on the real vocabulary.

On the default model's tokenizer (Qwen2.5-Coder-0.5B: byte-level BPE, 151,936 logits), for five JSON schemas
of growing difficulty (flat object; nested objects; an array of objects with enums; bounded numbers; string
regex patterns), each library compiles the schema (timed), then replays the token ids of valid instances
(json.dumps with compact separators, tokenized by the real tokenizer), timing before each token the fill of a
[1, ceil(vocab / 32)] int32 bitmask (the form the engine's sampler applies) and, separately, the consume
(advance) of the token. Every token is checked against the mask it followed and the end must be accepting.
Both libraries get the engine's JSON whitespace rule (tinymlx/sample/structured.py: at most 24 whitespace characters).
  - llguidance (what tinymlx uses): LLMatcher; the lexer is built lazily, so the first replay after a compile
    ("cold") pays for it and later replays of the same matcher (reset in between) do not.
  - outlines-core: Index(regex, vocabulary) precomputes every state's allowed tokens at compile time; the
    regex comes from outlines_core.json_schema.build_regex_from_schema. Its mask time grows with the number
    of allowed tokens (the bitmask is written from a token list: inside a free string, most of the
    vocabulary), and its regex drops minimum/maximum, so "bounded numbers" is a looser language there.
  - xgrammar is not measured: it needs torch, transformers and triton, which the engine never imports.
Reported per (library, schema): compile ms, tokens timed (all replays), mask mean / p50 / p99 / cold-mean us, consume
mean us, and the one-time vocabulary setup of each library.
"""

from __future__ import annotations

import json
import time
from importlib import metadata

import common
import llguidance
import llguidance.numpy
import numpy as np
import outlines_core
from matplotlib import pyplot as plt
from outlines_core.json_schema import build_regex_from_schema
from tqdm import tqdm

from tinymlx.loader import resolve_model_dir
from tinymlx.sample.structured import JSON_WHITESPACE as WHITESPACE
from tinymlx.text.tokenizer import Tokenizer

N_VOCAB = 151936
WORKLOADS = {"full": {"schemas": 5, "repeats": 5}, "quick": {"schemas": 2, "repeats": 2}}
XGRAMMAR_SKIPPED = "not measured: needs torch + transformers + triton, which the engine must never import"


def obj(props: dict, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False, **extra}


STR, INT = {"type": "string"}, {"type": "integer"}
SCHEMAS = [  # (name, schema, valid instances with keys in schema order)
    ("flat", obj({"name": STR, "age": INT, "email": STR}),
     [{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
      {"name": "Grace Hopper", "age": 85, "email": "grace@navy.mil"}]),
    ("nested", obj({"id": INT, "owner": obj({"name": STR, "address": obj({"street": STR, "city": STR, "zip": STR})}),
                    "contact": obj({"phone": STR, "verified": {"type": "boolean"}})}),
     [{"id": 7, "owner": {"name": "Alan Turing", "address": {"street": "1 Bletchley Park", "city": "Milton Keynes",
                                                                "zip": "MK3 6EB"}},
       "contact": {"phone": "+44 1908 640404", "verified": True}}]),
    ("array+enum", obj({"order": STR, "items": {"type": "array", "items": obj({
        "sku": STR, "status": {"enum": ["in_stock", "backordered", "discontinued"]}, "qty": INT})}}),
     [{"order": "A-1001", "items": [{"sku": "KB-87", "status": "in_stock", "qty": 2},
                                    {"sku": "MS-12", "status": "backordered", "qty": 1},
                                    {"sku": "HD-4T", "status": "discontinued", "qty": 5}]},
      {"order": "B-7", "items": []}]),
    ("bounded numbers", obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                             "lon": {"type": "number", "minimum": -180, "maximum": 180},
                             "altitude_m": {"type": "integer", "minimum": 0, "maximum": 9000},
                             "accuracy": {"type": "number", "exclusiveMinimum": 0}}),
     [{"lat": 48.8584, "lon": 2.2945, "altitude_m": 330, "accuracy": 4.5},
      {"lat": -33.8568, "lon": 151.2153, "altitude_m": 12, "accuracy": 0.25}]),
    ("string patterns", obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                             "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
                             "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
     [{"id": "ABC-1234", "version": "2.10.3", "date": "2024-05-17"},
      {"id": "XYZ-0007", "version": "0.1.0", "date": "1999-12-31"}]),
]


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: byte-level BPE token text -> the bytes it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    rest = [b for b in range(256) if b not in bs]
    cs = bs + [256 + n for n in range(len(rest))]
    bs += rest
    return {chr(c): b for b, c in zip(bs, cs)}


def outlines_vocabulary(tokenizer_json: str, eos: int) -> outlines_core.Vocabulary:
    """The BPE vocabulary as bytes -> ids, without the added special tokens and the [PADn] fillers after them
    (the converted tokenizer.json lists both in model.vocab); outlines adds EOS itself."""
    decode, data = byte_decoder(), json.loads(tokenizer_json)
    first_added = min(t["id"] for t in data["added_tokens"])
    return outlines_core.Vocabulary(eos, {bytes(decode[ch] for ch in tok): [i]
                                          for tok, i in data["model"]["vocab"].items() if i < first_added})


def allowed(bitmask: np.ndarray, token: int) -> bool:
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)


def replay(lib: str, state, tokens: list[int], bitmask: np.ndarray) -> tuple[list[float], list[float], str | None]:
    """Mask then consume each token; (mask us, consume us, error or None)."""
    mask_us, consume_us = [], []
    for t in tokens:
        t0 = time.perf_counter_ns()
        if lib == "llguidance":
            llguidance.numpy.fill_next_token_bitmask(state, bitmask, 0)
        else:
            state.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)
        t1 = time.perf_counter_ns()
        if not allowed(bitmask, t):
            return mask_us, consume_us, f"token {t} not in the mask after {len(mask_us)} tokens"
        ok = state.consume_token(t) if lib == "llguidance" else state.advance(t, return_tokens=False) is None
        consume_us.append((time.perf_counter_ns() - t1) / 1e3)
        mask_us.append((t1 - t0) / 1e3)
        if lib == "llguidance" and not ok:
            return mask_us, consume_us, f"consume_token({t}) failed: {state.get_error()}"
    done = state.is_accepting() if lib == "llguidance" else state.is_finished()
    return mask_us, consume_us, None if done else "not accepting at the end"


def compile_schema(lib: str, schema: dict, lltok, vocab):
    if lib == "llguidance":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": WHITESPACE})
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher
    regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern=WHITESPACE)
    return outlines_core.Guide(outlines_core.Index(regex, vocab))


def bench(lib: str, schema: dict, instances: list[list[int]], repeats: int, lltok, vocab) -> dict:
    t0 = time.perf_counter()
    try:
        state = compile_schema(lib, schema, lltok, vocab)
    except Exception as e:  # noqa: BLE001 - an unsupported schema is a result, not a crash
        return {"error": f"compile: {type(e).__name__}: {e}"}
    out = {"compile_ms": (time.perf_counter() - t0) * 1e3, "mask_us": [], "consume_us": [], "cold_us": [],
           "errors": []}
    bitmask = llguidance.numpy.allocate_token_bitmask(1, N_VOCAB)
    for rep in range(repeats):
        for tokens in instances:
            state.reset()
            mask_us, consume_us, error = replay(lib, state, tokens, bitmask)
            out["mask_us"] += mask_us
            out["consume_us"] += consume_us
            out["cold_us"] += mask_us if rep == 0 else []
            if error and rep == 0:
                out["errors"].append(error)
    return out


def summary_row(lib: str, name: str, r: dict) -> list:
    if "error" in r:
        return [lib, name] + [None] * 7 + [r["error"][:80]]
    m = np.array(r["mask_us"])
    return [lib, name, r["compile_ms"], len(m), m.mean(), np.percentile(m, 50), np.percentile(m, 99),
            float(np.mean(r["cold_us"])), float(np.mean(r["consume_us"])), "; ".join(r["errors"]) or "ok"]


def plot(rows: list[list], schemas: list[str]) -> plt.Figure:
    fig, (ax_mask, ax_compile) = plt.subplots(1, 2, figsize=(13, 4.8))
    x, width = np.arange(len(schemas)), 0.2
    libs = ["llguidance", "outlines-core"]
    for k, lib in enumerate(libs):
        by = {r[1]: r for r in rows if r[0] == lib and isinstance(r[2], float)}
        for j, (col, label) in enumerate([(4, "mean"), (6, "p99")]):
            ys = [by[s][col] if s in by else 0 for s in schemas]
            ax_mask.bar(x + (2 * k + j - 1.5) * width, ys, width, label=f"{lib} {label}", alpha=1 - 0.4 * j,
                        color=f"C{k}")
        ax_compile.bar(x + (k - 0.5) * 2 * width, [by[s][2] if s in by else 0 for s in schemas], 2 * width,
                       label=lib, color=f"C{k}")
    for ax, title, ylabel in [(ax_mask, "mask per token (151,936-token vocabulary)", "µs / token"),
                              (ax_compile, "schema compile", "ms")]:
        ax.set_yscale("log")
        ax.set_xticks(x, schemas, rotation=15)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    return fig


def main() -> None:
    args = common.base_parser(__doc__.splitlines()[0]).parse_args()
    workload = WORKLOADS["quick" if args.quick else "full"]
    tok = Tokenizer.from_dir(resolve_model_dir(args.model))
    tokenizer_json, eos = tok.to_json(), sorted(tok.eos_token_ids)
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer_json, n_vocab=N_VOCAB, eos_token=eos)
    t1 = time.perf_counter()
    vocab = outlines_vocabulary(tokenizer_json, eos[0])
    setup_ms = {"llguidance": (t1 - t0) * 1e3, "outlines-core": (time.perf_counter() - t1) * 1e3}
    schemas = SCHEMAS[:workload["schemas"]]
    results, rows = {}, []
    for name, schema, instances in tqdm(schemas, desc="schemas"):
        token_ids = [tok.encode(json.dumps(i, separators=(",", ":")), add_special_tokens=False) for i in instances]
        for lib in ("llguidance", "outlines-core"):
            r = bench(lib, schema, token_ids, workload["repeats"], lltok, vocab)
            results[f"{lib}/{name}"] = r
            rows.append(summary_row(lib, name, r))
    rows.append(["xgrammar", "all"] + [None] * 7 + [XGRAMMAR_SKIPPED])
    headers = ["library", "schema", "compile ms", "tokens timed", "mask mean us", "p50 us", "p99 us", "cold mean us",
               "consume us", "replay check"]
    table = common.print_table(
        f"token-mask time, {N_VOCAB:,}-token vocabulary, {workload['repeats']} replays per instance (one-time "
        f"vocabulary setup: llguidance {setup_ms['llguidance']:.0f} ms, outlines-core "
        f"{setup_ms['outlines-core']:.0f} ms)", headers, rows)
    versions = {lib: metadata.version(lib) for lib in ("llguidance", "outlines-core")} | {"xgrammar": XGRAMMAR_SKIPPED}
    payload = {"workload": {**workload, "whitespace_pattern": WHITESPACE, "n_vocab": N_VOCAB,
                            "schemas": [{"name": n, "schema": s, "instances": i} for n, s, i in schemas]},
               "versions": versions, "vocab_setup_ms": setup_ms, "table": table, "results": results}
    common.save_results("grammar_libraries", args.quick, common.machine_info(args.dtype), payload,
                        plot(rows, [s[0] for s in schemas]))


if __name__ == "__main__":
    main()
