"""Structured output: request constraints (JSON schema, any JSON, regex, choice, grammar) -> token masks.

llguidance does the matching (a Rust lexer/parser over the tokenizer's token trie: about 50 us per
mask on a 150k vocabulary, nothing precomputed per schema; see benchmarks/structured.py). This file
owns one matcher per constrained sequence:

    add_request  -> compile the grammar, refuse a bad one before anything is queued
    step         -> one bitmask row per sampled position (a verified chunk: the position after
                    each draft), filled in parallel, applied by the sampler
    commit       -> the matcher consumes the kept tokens; a stopped matcher ends the request

A matcher's state is a function of the sequence's output tokens, which recompute preemption keeps,
so preemption needs nothing here; a finished or aborted sequence just drops its matcher.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tinymlx.core.batch import ScheduledChunk
from tinymlx.core.sampling_params import Constraint

# Runs of whitespace inside JSON are bounded: an unbounded run lets a weak model (or plain bad luck
# at temperature 1) pad forever and hit max_tokens mid-value. 24 covers newline + 5 levels of indent.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"
# A request's constraint is checked where it is validated (often on the caller's thread) and again
# where its matcher starts; n choices share one. Validated grammars are kept, the newest this many.
_NUM_KEPT_GRAMMARS = 256


class TokenMasks(NamedTuple):
    """Allowed tokens of some sampled rows: bit t of bitmask[j] (32 per int32 word) allows token t
    in row rows[j]. Rows not listed are unconstrained."""

    rows: list[int]
    bitmask: np.ndarray  # [len(rows), ceil(vocab / 32)] int32


class StructuredOutput:
    """The matchers of one engine's constrained sequences. Built on the first constrained request:
    wrapping a 150k-token vocabulary takes about a second, which unconstrained engines never pay."""

    def __init__(self, tokenizer_json: str, eos_token_ids: Sequence[int], vocab_size: int):
        import llguidance

        self._ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor()
        self._matchers: dict[int, object] = {}
        self._grammars: dict[Constraint, str] = {}  # validated, oldest first
        self._grammars_lock = threading.Lock()  # callers' threads validate while the step thread adds

    def grammar(self, constraint: Constraint) -> str:
        """llguidance's grammar text for `constraint`; ValueError if it is malformed or unsupported."""
        grammar = self._grammars.get(constraint)
        if grammar is None:
            grammar = self._validated(constraint)
            with self._grammars_lock:
                self._grammars[constraint] = grammar
                if len(self._grammars) > _NUM_KEPT_GRAMMARS:
                    del self._grammars[next(iter(self._grammars))]
        return grammar

    def _validated(self, constraint: Constraint) -> str:
        try:
            grammar = self._grammar_text(constraint)
            is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as e:  # llguidance raises any of these for bad input
            is_error, messages = True, [str(e)]
        if is_error:
            raise ValueError(f"invalid {constraint.kind} constraint: {messages[0]}")
        return grammar

    def _grammar_text(self, constraint: Constraint) -> str:
        ll = self._ll.LLMatcher
        kind, spec = constraint
        options = {"whitespace_pattern": JSON_WHITESPACE}
        if kind == "json_schema":
            return ll.grammar_from_json_schema(spec, defaults=options)
        if kind == "json_object":
            return ll.grammar_from_json_schema({"type": "object"}, defaults=options)
        if kind == "regex":  # \d as [0-9], as people mean it (Rust's \d is every Unicode digit)
            return ll.grammar_from_regex(self._ll.regex_to_lark(spec, "d"))
        if kind == "choice":
            return self._ll.grammar_from("choice", spec)
        return self._ll.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark

    def add(self, seq_id: int, constraint: Constraint) -> None:
        """Start a matcher for `seq_id`; ValueError (and nothing kept) if the constraint is bad."""
        matcher = self._ll.LLMatcher(self.tokenizer, self.grammar(constraint), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {constraint.kind} constraint: {matcher.get_error()}")
        self._matchers[seq_id] = matcher

    def masks(self, chunks: Sequence[ScheduledChunk]) -> TokenMasks | None:
        """Sample stage: the constrained rows' allowed tokens, one row per sampled position in the
        sampler's row order (a verified chunk samples each of its drafts' positions too)."""
        constrained, row = [], 0
        for chunk in chunks:
            if chunk.seq_id in self._matchers:
                constrained.append((chunk.seq_id, row, chunk.draft_token_ids))
            row += chunk.num_logits
        return self.row_masks(constrained) if constrained else None

    def row_masks(self, rows: Sequence[tuple[int, int, list[int]]]) -> TokenMasks:
        """Bitmasks for (seq_id, first row, drafts): row first + i allows what may follow drafts[:i].
        A draft the grammar refuses leaves the rows after it unconstrained: the sample at its own
        row differs from it, so nothing after it is kept."""
        num_rows = sum(len(drafts) + 1 for _, _, drafts in rows)
        bitmask = np.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        plain, drafted, sampled_rows, at = [], [], [], 0
        for seq_id, first, drafts in rows:
            matcher = self._matchers[seq_id]
            if drafts:
                drafted.append((matcher, at, list(drafts)))
            else:
                plain.append((matcher, at))
            sampled_rows += range(first, first + len(drafts) + 1)
            at += len(drafts) + 1
        # Matchers in parallel; a drafted one advances through its drafts and back.
        pointer, row_bytes = bitmask.ctypes.data, bitmask.shape[1] * 4
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, pointer, row_bytes, num_rows)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, pointer, row_bytes, num_rows)
        return TokenMasks(sampled_rows, bitmask)

    def advance(self, seq_id: int, token: int) -> bool:
        """Commit stage: the matcher consumes a kept token; True when the grammar is complete (nothing
        may follow). An unconstrained sequence has no matcher: False."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False
        if not matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed: "
                               f"{matcher.get_error()}")
        return matcher.is_stopped()

    def forget(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
