"""What the model's chat template makes of a ChatTurn: its prompt, its call grammar, its reply's parser.

The call syntax (hermes, xml, llama3, harmony, gemma4) is read from the template's text once, or set by
`--tool-call-parser`. A turn that offers tools is always sampled under the call grammar (lazy under
"auto": free text until a call opens), so a call the parser sees is well formed and fits its schema.
A harmony (gpt-oss) or Gemma 4 reply is read with its control tokens kept: they are its markup.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinymlx.core.images import PromptImages
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.engine.engine import Engine
from tinymlx.turns.api_error import APIError
from tinymlx.turns.reasoning import starts_in_reasoning
from tinymlx.turns.reply_format import ReplyFormat
from tinymlx.turns.tool_calls import SYNTAXES, OutputParser
from tinymlx.turns.tool_grammar import call_grammar, check_tools, markup_tokens
from tinymlx.turns.turn import ChatTurn

# Enough of a prompt's end to hold a generation prompt's opening "<think>\n".
_PROMPT_TAIL_TOKENS = 8


@dataclass(frozen=True)
class PreparedTurn:
    token_ids: list[int]  # the prompt
    grammar: str | None  # the call grammar its reply is sampled under (None: no tools on offer)
    starts_in_reasoning: bool  # the prompt opened <think>: the reply begins inside it
    images: PromptImages | None = None  # the prompt's images, their tokens in `token_ids`


class TurnTemplate:
    def __init__(self, engine: Engine, call_syntax: str | None = None):
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.format = ReplyFormat.of_template(self.tokenizer.chat_template_source, call_syntax)
        self._markup_tokens = markup_tokens(self.tokenizer)

    def prepare(self, turn: ChatTurn, field: str = "messages", tools_field: str = "tools") -> PreparedTurn:
        """The turn's prompt and call grammar; APIError for a conversation or tools this model cannot take."""
        if turn.offers_tools and self.format.call_syntax is None:
            raise APIError(400, "this model's chat template has no tool-call syntax; start the server with "
                                f"--tool-call-parser {{{','.join(SYNTAXES)}}} to name one", tools_field)
        token_ids, images = self.prompt_with_images(turn, field)
        tail = self.tokenizer.decode(token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        opened = self.format.thinks and starts_in_reasoning(tail)
        grammar = None
        if turn.offers_tools:
            try:
                check_tools(turn.callable_tools)
                reasoning = "open" if opened else "optional" if self.format.thinks else "none"
                grammar = call_grammar(self.format.call_syntax, turn.callable_tools, turn.tool_choice,
                                       turn.parallel_tool_calls, reasoning=reasoning, markup_tokens=self._markup_tokens)
                self._engine.check_constraint(SamplingParams(grammar=grammar))
            except ValueError as error:
                raise APIError(400, f"{tools_field}: {error}", tools_field, "invalid_tool_schema") from None
        return PreparedTurn(token_ids, grammar, opened, images)

    def prompt(self, turn: ChatTurn, field: str = "messages") -> list[int]:
        return self.prompt_with_images(turn, field)[0]

    def prompt_with_images(self, turn: ChatTurn, field: str = "messages") -> tuple[list[int], PromptImages | None]:
        """The prompt's ids, each image's placeholder expanded to its tokens, and where the images sit (a text
        model's images are a note, or a 400 under --images refuse: engine/image_intake.py)."""
        try:
            messages, images = self._engine.images.split([message.template_dict() for message in turn.messages])
        except ValueError as error:
            raise APIError(400, str(error), field, "invalid_image") from None
        kwargs = dict(turn.template_kwargs)
        if turn.tools:  # listed even under "none", so the prompt's prefix stays that of the other turns
            kwargs["tools"] = [tool.template_dict() for tool in turn.tools]
        try:
            token_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        except ValueError as error:
            raise APIError(400, f"{field}: {error}", field) from None
        except Exception as error:  # noqa: BLE001 - a template's raise_exception or a Jinja error on odd input
            raise APIError(400, f"{field}: the chat template refused the conversation: {error}", field) from None
        if not token_ids:
            raise APIError(400, f"{field}: the prompt is empty", field)
        try:
            return self._engine.place_images(token_ids, images)
        except ValueError as error:
            raise APIError(400, f"{field}: {error}", field, "invalid_image") from None

    def parser(self, turn: ChatTurn, prepared: PreparedTurn) -> OutputParser:
        return self.format.parser(turn.callable_tools if turn.offers_tools else (), prepared.starts_in_reasoning,
                                  prepared.grammar is not None, turn.parallel_tool_calls)
