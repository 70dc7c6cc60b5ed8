"""Call grammars: llguidance Lark text for the model's call syntax around each tool's parameter schema,
so a call the model makes parses and validates (SamplingParams(grammar=...)).

    "required"     one or more calls and nothing else (one if not parallel_tool_calls)
    a tool's name  exactly one call of that tool
    "auto"         free text, then optionally calls: the grammar is lazy, it binds only once the
                   call's opening tag is written (<tool_call>; for llama3 a reply opening with "{").
                   After the calls only whitespace may follow, then the end: the Qwen and Llama
                   templates end a turn after its calls, and the chat wire format has no place for
                   text after them. Text may not contain the opening tag spelled out in pieces either,
                   so whatever the parser takes for a call went through the grammar.
                   hermes also takes one untagged call, the call's JSON as the whole reply, bare or
                   in a ```json fence (Qwen2.5-Coder writes no tags): a reply that opens with
                   `{"name"` (after whitespace and the fence) is that call, so text may not open so.
    "none"         no grammar

harmony (gpt-oss) is a grammar of the whole reply: its messages, each on a channel (analysis, commentary,
final), and a call as a commentary message to `functions.NAME` ending in <|call|>. "auto" lets the reply
end in a final message or a call; "required" and a tool's name end it in a call, after any analysis. The
model ends its reply at <|call|>, so it makes one call at most.

Markup the vocabulary has as single tokens (Qwen's <tool_call>, Qwen3's <think>, Llama's
<|python_tag|>) is written as the token (`<tool_call>` in Lark), which is what the model emits; other
markup as text. `markup_tokens(tokenizer)` says which; by default the syntax's own tags are assumed
to be tokens, as they are in every Qwen2.5 / Qwen3 / Qwen3.5 / Llama 3.1+ vocabulary.

`reasoning` says whether a <think> block comes first: "none"; "optional" (the model may open one:
Qwen3); "open" (the prompt opened it: Qwen3.5, Qwen3-thinking; reasoning text until </think>).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import llguidance

from tinymlx.sample.structured import JSON_WHITESPACE
from tinymlx.turns.call_markup import (
    CALL_CLOSE,
    CALL_OPEN,
    PYTHON_TAG,
    UNTAGGED_FENCE_CLOSE,
    UNTAGGED_FENCES,
    UNTAGGED_KEY,
)
from tinymlx.turns.freeform_grammar import freeform_rules, regex_literal
from tinymlx.turns.gemma_calls import gemma_grammar
from tinymlx.turns.reasoning import THINK_CLOSE, THINK_OPEN
from tinymlx.turns.tool_calls import SYNTAXES
from tinymlx.turns.tool_schema import parameter_schema, xml_value_kind
from tinymlx.turns.turn import Freeform, Tool, ToolChoice

REASONING_STARTS = ("none", "optional", "open")
_MARKUP = (CALL_OPEN, CALL_CLOSE, THINK_OPEN, THINK_CLOSE, PYTHON_TAG)
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
# Between calls, and after the last: the newline the templates write, bounded like JSON's whitespace.
_SEPARATOR = r"SEP: /[ \t\r\n]{1,8}/"
_ANY_SPACE = r"[ \t\r\n]*"


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def markup_tokens(tokenizer: _Encoder) -> frozenset[str]:
    """The call and reasoning tags that are single tokens of this tokenizer's vocabulary."""
    return frozenset(tag for tag in _MARKUP if len(tokenizer.encode(tag, add_special_tokens=False)) == 1)


def check_tools(tools: Sequence[Tool]) -> None:
    """ValueError naming the first tool that cannot be called: a repeated name, or parameters that are
    not the JSON schema of an object, or that llguidance cannot compile."""
    names: set[str] = set()
    for tool in tools:
        if tool.name in names:
            raise ValueError(f"two tools are named {tool.name!r}")
        names.add(tool.name)
        if not tool.name or any(char.isspace() or char in '<>"' for char in tool.name):
            raise ValueError(f"tool {tool.name!r}: a name needs 1 or more characters, none of them "
                             "whitespace, <, > or \"")
        if tool.freeform is not None:
            _check_freeform(tool.name, tool.freeform)
        parameters = tool.parameters
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ValueError(f"tool {tool.name!r}: parameters must be the JSON schema of an object")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(_object_schema(tool), defaults=_JSON_OPTIONS)
            error = llguidance.LLMatcher.validate_grammar(grammar)
        except (ValueError, TypeError, RuntimeError) as e:  # llguidance raises any of these for bad input
            error = str(e)
        if error:
            raise ValueError(f"tool {tool.name!r}: its parameters schema is refused: {error}")


def call_grammar(syntax: str | None, tools: Sequence[Tool], tool_choice: ToolChoice, parallel_tool_calls: bool,
                 *, reasoning: str = "none", markup_tokens: Collection[str] | None = None) -> str | None:
    """The Lark grammar of a reply that calls `tools` as `tool_choice` says; None when nothing is
    constrained. ValueError for an unknown syntax, reasoning start or tool_choice name."""
    if tool_choice == "none" or not tools or syntax is None:
        return None
    if syntax not in SYNTAXES:
        raise ValueError(f"unknown tool-call syntax {syntax!r}; choose one of {', '.join(SYNTAXES)}")
    if reasoning not in REASONING_STARTS:
        raise ValueError(f"unknown reasoning start {reasoning!r}; choose one of {', '.join(REASONING_STARTS)}")
    if tool_choice not in ("auto", "required"):
        tools = [tool for tool in tools if tool.name == tool_choice]
        if not tools:
            raise ValueError(f"tool_choice names {tool_choice!r}, which is not one of the tools")
    tokens = frozenset(_MARKUP if markup_tokens is None else markup_tokens)
    if syntax == "harmony":
        return _HarmonyGrammar(tools).text(tool_choice)
    if syntax == "gemma4":
        return gemma_grammar(tools, tool_choice, parallel_tool_calls)
    return _Grammar(syntax, tools, tokens).text(tool_choice, parallel_tool_calls, reasoning)


class _Arguments:
    """A call's arguments: the JSON object of its parameters' schema, or a freeform tool's quoted input."""

    def __init__(self, rules: list[str]):
        self._rules = rules
        self._freeform: set[str] = set()  # the freeform grammars already in the rules, by start rule

    def _arguments(self, i: int, tool: Tool) -> str:
        if tool.freeform is None:
            return f"%json {_json(_rooted(_object_schema(tool), tool))}"
        return f'"{{\\"input\\": \\"" {self._input(i, tool.freeform, quoted=True)} "\\"}}"'

    def _input(self, i: int, freeform: Freeform, quoted: bool) -> str:
        """The start rule of tool i's freeform grammar, its rules added once."""
        rules, start = freeform_rules(freeform, f"ff{i}", quoted)
        if start not in self._freeform:
            self._rules += rules
            self._freeform.add(start)
        return start


class _HarmonyGrammar(_Arguments):
    """gpt-oss's reply: messages on channels, a call `<|channel|>commentary to=functions.NAME <|constrain|>json
    <|message|>{...}<|call|>` (the markup is the vocabulary's control tokens)."""

    def __init__(self, tools: Sequence[Tool]):
        super().__init__(["%llguidance {}", "TEXT: /(?s:.*)/"])
        self._tools = tools

    def text(self, tool_choice: str) -> str:
        names = " | ".join(f"fn{i}" for i in range(len(self._tools)))
        self._rules.append(f'call: <|channel|> "commentary to=functions." ({names})')
        for i, tool in enumerate(self._tools):
            self._rules.append(f'fn{i}: {_literal(tool.name)} " " <|constrain|> "json" <|message|> '
                               f"{self._arguments(i, tool)} <|call|>")
        self._rules.append('next: <|end|> <|start|> "assistant"')
        if tool_choice == "auto":  # reasoning and preambles, then the answer or a call
            self._rules.append('note: <|channel|> ("analysis" | "commentary") <|message|> TEXT')
            self._rules.append('start: (note next)* (<|channel|> "final" <|message|> TEXT | call)')
        else:
            self._rules.append('start: (<|channel|> "analysis" <|message|> TEXT next)* call')
        return "\n".join(self._rules) + "\n"


class _Grammar(_Arguments):
    def __init__(self, syntax: str, tools: Sequence[Tool], tokens: frozenset[str]):
        super().__init__(["%llguidance {}", _SEPARATOR])
        self._syntax, self._tools, self._tokens = syntax, tools, tokens
        self._rules += self._llama3_calls(tools) if syntax == "llama3" else self._tagged_calls(tools)

    def text(self, tool_choice: str, parallel: bool, reasoning: str) -> str:
        if self._syntax == "llama3":
            python_tag = f"{PYTHON_TAG}? " if PYTHON_TAG in self._tokens else ""
            more = ' (";" SEP? call)*' if parallel and tool_choice in ("auto", "required") else ""
            self._rules.append(f"calls: {python_tag}SEP? call{more}")
            # A reply that opens with "{" is a call; any other is text.
            self._rules.append(r"PLAIN: /[ \t\r\n]*([^{ \t\r\n](?s:.*))?/")
            body = "PLAIN | calls" if tool_choice == "auto" else "calls"
        else:
            many = parallel and tool_choice in ("auto", "required")
            self._rules.append("calls: call (SEP? call)* SEP?" if many else "calls: call")
            body = "SEP? calls"
            if tool_choice == "auto":
                # hermes: text may not open as an untagged call, with any whitespace (the call's is bounded)
                is_hermes = self._syntax == "hermes"
                not_untagged = f" & ~/{_untagged_opening(_fences() + '?', _ANY_SPACE)}(?s:.*)/" if is_hermes else ""
                self._rules.append(self._text_lexeme("TEXT", [CALL_OPEN] + self._think_tags(reasoning)) + not_untagged)
                if CALL_OPEN in self._tokens:
                    body = "TEXT | TEXT calls"
                else:  # spelled out, the opening tag ends the text lazily (no lexeme can give it back)
                    self._rules.append(f"head[lazy]: /(?s:.*){regex_literal(CALL_OPEN)}/{not_untagged}")
                    self._rules.append("calls_after_head: call_rest (SEP? call)* SEP?" if many
                                       else "calls_after_head: call_rest")
                    body = "TEXT | head calls_after_head"
                if is_hermes:
                    self._rules += self._untagged_call()
                    body += " | untagged"
        self._rules.append(f"body: {body}")
        self._rules.append("start: " + self._start(reasoning))
        return "\n".join(self._rules) + "\n"

    def _start(self, reasoning: str) -> str:
        if reasoning == "none":
            return "body"
        if THINK_CLOSE in self._tokens:
            self._rules.append(self._text_lexeme("REASONING", [THINK_CLOSE]))
            self._rules.append(f"reasoning: REASONING {THINK_CLOSE}")
        else:
            self._rules.append(f"reasoning[lazy]: /(?s:.*){regex_literal(THINK_CLOSE)}/")
        if reasoning == "open":
            return "reasoning body"
        return f"body | {self._markup(THINK_OPEN)} reasoning body"

    def _think_tags(self, reasoning: str) -> list[str]:
        return [THINK_OPEN, THINK_CLOSE] if reasoning != "none" else []

    def _tagged_calls(self, tools: Sequence[Tool]) -> list[str]:
        rules = [f"call: {self._markup(CALL_OPEN)} call_rest"]
        close = self._markup(CALL_CLOSE)
        if self._syntax == "hermes":
            rules.append(f'call_rest: "\\n" ({" | ".join(f"fn{i}" for i in range(len(tools)))}) "\\n" {close}')
            rules += [self._json_call(i, tool, "arguments") for i, tool in enumerate(tools)]
            return rules
        rules.append(f'call_rest: "\\n<function=" ({" | ".join(f"fn{i}" for i in range(len(tools)))}) '
                     f'"</function>\\n" {close}')
        rules.append(f"xml_text[lazy]: /(?s:.*){regex_literal(chr(10) + '</parameter>')}/")
        for i, tool in enumerate(tools):
            if tool.freeform is not None:  # its input, raw, is the one parameter
                rules.append(f'fn{i}: {_literal(tool.name + ">" + chr(10) + "<parameter=input>" + chr(10))} '
                             f'{self._raw_input(i, tool)} "\\n"')
                continue
            properties = tool.parameters.get("properties") or {}
            required = set(tool.parameters.get("required") or ())
            parameters = []
            for j, key in enumerate(properties):
                value = self._xml_value(tool, parameter_schema(tool, key))
                rules.append(f'p{i}_{j}: {_literal(f"<parameter={key}>" + chr(10))} {value} "\\n"')
                parameters.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
            rules.append(f"fn{i}: {_literal(tool.name + '>' + chr(10))} {' '.join(parameters)}")
        return rules

    def _untagged_call(self) -> list[str]:
        """One hermes call without its tags as the whole reply, bare or fenced. Its head, up to the
        arguments, is one lexeme: TEXT (which never opens with `{"name"`) dies inside it, so the two
        part there; as a lexeme per piece, the "{" would lose to TEXT's longer match (llguidance's
        lexer ends a lexeme only when no other can go on) and never be read."""
        fences = _fences()
        rules = [f"untagged: ({' | '.join(f'u{i}' for i in range(len(self._tools)))}) SEP?",
                 rf"UEND: /{JSON_WHITESPACE}\}}/",
                 rf"UFEND: /{JSON_WHITESPACE}\}}\n{regex_literal(UNTAGGED_FENCE_CLOSE)}/"]
        for i, tool in enumerate(self._tools):
            rest = (f"{JSON_WHITESPACE}:{JSON_WHITESPACE}{regex_literal(_literal(tool.name))}{JSON_WHITESPACE},"
                    f'{JSON_WHITESPACE}"arguments"{JSON_WHITESPACE}:{JSON_WHITESPACE}')
            rules.append(f"U{i}: /{_untagged_opening('', JSON_WHITESPACE)}{rest}/")
            rules.append(f"UF{i}: /{_untagged_opening(fences, JSON_WHITESPACE)}{rest}/")
            rules.append(f"u{i}: U{i} a{i} UEND | UF{i} a{i} UFEND")
            rules.append(f"a{i}: {self._arguments(i, tool)}")
        return rules

    def _json_call(self, i: int, tool: Tool, arguments_key: str) -> str:
        """fn{i}: the call's JSON, {"name": ..., <arguments_key>: ...}."""
        if tool.freeform is None:
            return f"fn{i}: %json {_json(_call_schema(tool, arguments_key))}"
        head = _literal(f'{{"name": {_literal(tool.name)}, "{arguments_key}": ')
        return f'fn{i}: {head} {self._arguments(i, tool)} "}}"'

    def _raw_input(self, i: int, tool: Tool) -> str:
        """xml's <parameter=input>: the freeform text itself, then the closing tag."""
        if tool.freeform is None or tool.freeform.syntax == "text":
            return "xml_text"  # any text, up to the closing tag
        return f'{self._input(i, tool.freeform, quoted=False)} "\\n</parameter>"'

    def _xml_value(self, tool: Tool, schema: Any) -> str:
        """A parameter's value and its closing tag: its type decides the value's form."""
        kind = xml_value_kind(schema)
        values = schema.get("enum") if isinstance(schema, dict) else None
        if kind == "string" and isinstance(values, list) and values and all(isinstance(v, str) for v in values):
            return f'({" | ".join(map(_literal, values))}) "\\n</parameter>"'
        if kind == "json":
            return f'%json {_json(_rooted(schema, tool))} "\\n</parameter>"'
        return "xml_text"  # a string, or a value of no one type: raw text up to the closing tag

    def _llama3_calls(self, tools: Sequence[Tool]) -> list[str]:
        rules = [f"call: {' | '.join(f'fn{i}' for i in range(len(tools)))}"]
        return rules + [self._json_call(i, tool, "parameters") for i, tool in enumerate(tools)]

    def _markup(self, tag: str) -> str:
        return tag if tag in self._tokens else _literal(tag)

    def _text_lexeme(self, name: str, tags: list[str]) -> str:
        """Any text without these tags spelled out (the tokens themselves are never text)."""
        spelled = "|".join(map(regex_literal, tags))
        return f"{name}: /(?s:.*)/ & ~/(?s:.*)({spelled})(?s:.*)/"


def _check_freeform(name: str, freeform: Freeform) -> None:
    """A freeform tool's own grammar, raw, compiled: ValueError with llguidance's message."""
    if freeform.syntax == "text":
        return
    try:
        rules, start = freeform_rules(freeform, "ff", quoted=False)
        error = llguidance.LLMatcher.validate_grammar(
            llguidance.grammar_from("lark", "\n".join(["%llguidance {}", f"start: {start}", *rules]) + "\n"))
    except (ValueError, TypeError, RuntimeError) as e:
        error = str(e)
    if error:
        raise ValueError(f"tool {name!r}: its {freeform.syntax} grammar is refused: {error}")


def _fences() -> str:
    return "(" + "|".join(map(regex_literal, UNTAGGED_FENCES)) + ")"


def _untagged_opening(fence: str, whitespace: str) -> str:
    """How an untagged call opens, as a regex: whitespace, `fence`, "{", `whitespace`, "name"."""
    return rf"{_ANY_SPACE}{fence}\{{{whitespace}{regex_literal(UNTAGGED_KEY)}"


def _object_schema(tool: Tool) -> dict[str, Any]:
    return {"type": "object", **tool.parameters}


def _call_schema(tool: Tool, arguments_key: str) -> dict[str, Any]:
    """{"name": <the tool's name>, <arguments_key>: <its parameters>}, name first."""
    parameters = {k: v for k, v in _object_schema(tool).items() if k not in ("$defs", "definitions")}
    call = {"type": "object", "properties": {"name": {"const": tool.name}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}
    return _rooted(call, tool)


def _rooted(schema: Any, tool: Tool) -> dict[str, Any]:
    """`schema` as a grammar's root: JSON options, and the tool's definitions where "#/$defs/..." finds them."""
    rooted = dict(schema) if isinstance(schema, dict) else {}
    for key in ("$defs", "definitions"):
        if key in tool.parameters:
            rooted[key] = tool.parameters[key]
    rooted["x-guidance"] = _JSON_OPTIONS
    return rooted


def _json(schema: dict[str, Any]) -> str:
    return json.dumps(schema, ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


