"""SpeculativeConfig: the `speculative` setting parsed (which proposers, how far they draft)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft" | "ngram+draft" | "mtp"
    draft_model: str | None = None
    max_draft_tokens: int = 6
    ngram_max: int = 4  # longest suffix looked up
    ngram_min: int = 2  # shortest suffix that may propose
    adaptive: bool = True  # False: every decoding sequence drafts max_draft_tokens, whatever it costs

    @classmethod
    def parse(cls, spec: str) -> SpeculativeConfig:
        """"ngram", "ngram:max_draft=8,max_n=5,min_n=2,adaptive=0", "draft:<model>[,max_draft=4]",
        "ngram+draft:<model>[,options of both]", or "mtp[:k][,max_draft=k,adaptive=0]" (the checkpoint's own
        multi-token-prediction head, k drafts: 3 unless given)."""
        method, _, rest = spec.partition(":")
        keys = {"max_draft": "max_draft_tokens", "max_n": "ngram_max", "min_n": "ngram_min", "adaptive": "adaptive"}
        values: dict = {}
        if method in ("draft", "ngram+draft"):
            model, *options = rest.split(",")
            if not model:
                raise ValueError(f"speculative='{method}:<model>' needs a model: a directory, .gguf, offline name or "
                                 "Hub id")
            values["draft_model"] = model
        elif method == "ngram":
            options = [o for o in rest.split(",") if o]
        elif method == "mtp":
            options = [o if "=" in o else f"max_draft={o}" for o in rest.split(",") if o]  # mtp:k
            values["max_draft_tokens"] = 3  # a head trained one token ahead: its later guesses fade fast
        else:
            raise ValueError(f"speculative must be 'ngram', 'draft:<model>', 'ngram+draft:<model>' or 'mtp[:k]', "
                             f"got {spec!r}")
        for option in options:
            key, _, value = option.partition("=")
            if key == "adaptive" and value in ("0", "1"):
                values["adaptive"] = value == "1"
            elif key in keys and key != "adaptive" and value.isdigit() and int(value) >= 1:
                values[keys[key]] = int(value)
            else:
                raise ValueError(f"speculative option {option!r}: expected max_draft, max_n or min_n = a positive "
                                 "int, or adaptive = 0 or 1")
        config = cls(method, **values)
        if config.ngram_min > config.ngram_max:
            raise ValueError(f"speculative: min_n ({config.ngram_min}) is above max_n ({config.ngram_max})")
        return config

    @property
    def proposers(self) -> tuple[str, ...]:
        """The proposers' names, in the order they are offered a sequence: the free one first."""
        return tuple(self.method.split("+"))
