"""How a chat template's replies read, decided once from its text: the call syntax, whether a reply carries
reasoning apart from its answer, and whether its control tokens are markup the parser needs. The server's
three APIs and the chat UI read replies through the same parser this makes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tinymlx.core.sampling_params import SamplingParams
from tinymlx.turns.call_streams import new_call_id
from tinymlx.turns.gemma_calls import THOUGHT_CLOSE, THOUGHT_OPEN
from tinymlx.turns.reasoning import THINK_CLOSE, THINK_OPEN
from tinymlx.turns.tool_calls import SYNTAXES, OutputParser, syntax_for_template
from tinymlx.turns.turn import Tool


@dataclass(frozen=True)
class ReplyFormat:
    call_syntax: str | None  # hermes, xml, llama3, harmony, gemma4; None: the template teaches no calls
    thinks: bool  # replies carry reasoning apart from the answer (<think>, harmony's analysis channel)
    keeps_markup: bool  # detokenize replies with their control tokens (harmony's and Gemma 4's markup is)
    reasoning_tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)  # Gemma 4's: <|channel>thought ... <channel|>

    @classmethod
    def of_template(cls, chat_template_source: str, call_syntax: str | None = None) -> ReplyFormat:
        """`call_syntax` overrides the one read from the template (--tool-call-parser)."""
        if call_syntax is not None and call_syntax not in SYNTAXES:
            raise ValueError(f"unknown tool-call syntax {call_syntax!r}; choose one of {', '.join(SYNTAXES)}")
        syntax = call_syntax or syntax_for_template(chat_template_source)
        is_harmony = syntax == "harmony"
        # Gemma 4's thought block and calls are control tokens too: kept for the parser
        if syntax == "gemma4" or THOUGHT_CLOSE in chat_template_source:
            return cls(syntax, True, True, (THOUGHT_OPEN, THOUGHT_CLOSE))
        return cls(syntax, THINK_OPEN in chat_template_source or is_harmony, is_harmony)

    def reading(self, params: SamplingParams) -> SamplingParams:
        """`params` as this format's replies are sampled: with their control tokens kept where they are markup."""
        return dataclasses.replace(params, skip_special_tokens=False) if self.keeps_markup else params

    def parser(self, tools: Sequence[Tool] = (), starts_in_reasoning: bool = False, constrained: bool = False,
               parallel_tool_calls: bool = True, new_call_id: Callable[[], str] = new_call_id) -> OutputParser:
        """A reply's parser; `tools`: the ones it may call (none: calls are text). A harmony reply is read
        as harmony whatever it may call."""
        syntax = self.call_syntax if tools or self.keeps_markup else None
        return OutputParser(syntax, tools, starts_in_reasoning=starts_in_reasoning, constrained=constrained,
                            parallel_tool_calls=parallel_tool_calls, new_call_id=new_call_id,
                            splits_reasoning=self.thinks, reasoning_tags=self.reasoning_tags)


PLAIN = ReplyFormat(None, thinks=False, keeps_markup=False)  # no template: a base model's text, all answer
