"""IncrementalDetokenizer: token ids in, text deltas out, UTF-8 safe, stop strings held back.

Decoding works on a short window of ids, as in HF's TextStreamer and vLLM (prefix/read offsets):

    _ids:  [ context: text already out | new: text not yet out ]
             0                          _read_offset             len

`decode(context + new)` minus `decode(context)` is the new text. Decoding the context again gives
the tokenizer what it needs for leading spaces and byte merges. When the result ends in U+FFFD a
multi-byte character is still incomplete, so we wait for the next token. Once the new text is out,
`new` becomes the next context, so the window stays a few tokens long.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded in front of the first output token, so it gets its leading space right.
_PROMPT_CONTEXT = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(self._stop):
            raise ValueError(f"stop strings must be non-empty, got {self._stop!r}")
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids)[-_PROMPT_CONTEXT:]
        self._read_offset = len(self._ids)
        self._released = ""
        self._pending = ""  # decoded text that may still turn out to start a stop string
        self.stop_matched: str | None = None

    @property
    def text(self) -> str:
        return self._released + self._pending

    def add(self, token_id: int) -> str:
        """Take one output token; return the text that may be shown now ("" if held back)."""
        if self.stop_matched is not None:
            return ""
        self._ids.append(token_id)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """The sequence finished: release everything still held (nothing after a matched stop)."""
        if self.stop_matched is not None:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        skip = self._skip_special_tokens
        context = self._tokenizer.decode(self._ids[: self._read_offset], skip_special_tokens=skip)
        full = self._tokenizer.decode(self._ids, skip_special_tokens=skip)
        if not final and (len(full) <= len(context) or full.endswith("\ufffd")):
            return ""  # a character is still incomplete, or the tokens decode to nothing yet
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return full[len(context) :]

    def _release(self, new: str, final: bool) -> str:
        # A stop match can't start in released text: that text was held while it could.
        pending = self._pending + new
        match = self._first_stop(pending)
        if match is not None:
            pos, self.stop_matched = match
            pending, hold = pending[:pos], 0
        else:
            hold = 0 if final else self._stop_prefix_len(pending)
        delta, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self._released += delta
        return delta

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first (earliest end, then longest), with its start."""
        best = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
                best = (i, s)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of `text` that could still grow into a stop string."""
        return max(
            (k for s in self._stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
            default=0,
        )
