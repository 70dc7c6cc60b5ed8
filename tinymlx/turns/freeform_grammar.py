"""A freeform tool's input grammar as rules of the call grammar (tool_grammar.py).

A custom tool of the Responses API (Codex's apply_patch) takes raw text in the language of a Lark or
regex grammar. The model writes it inside its call syntax:

    raw     xml's <parameter=input>...</parameter>: the text itself, so the grammar is used as it is
    quoted  hermes' and llama3's JSON {"input": "..."}: the text JSON-escaped, so every terminal is
            rewritten to match the escaped form of what it matched (the string "a\\n" becomes "a\\\\n",
            a regex's "." also takes \\" and \\\\), and the call's JSON decodes to text the grammar takes

Rules and terminals are renamed under a prefix so that several grammars share the call grammar's
namespace. Lark's `common` terminals are written out (llguidance imports nothing else); `-> alias`
is dropped (it shapes parse trees, not the language).
"""

from __future__ import annotations

import ast
import json
import re

from tinymlx.turns.turn import Freeform

try:  # the parser of Python's re module: regex terminals are rewritten node by node
    from re import _constants as _sre
    from re import _parser as _sre_parse
except ImportError:  # Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")
_JSON_SPECIAL = [chr(code) for code in range(0x20)] + ['"', "\\"]
_PLAIN = r'[^\x00-\x1f"\\]'  # what JSON writes as itself (intersected with a class)

_TOKEN = re.compile(r"""
    (?P<comment>(//|\#)[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imsx]*)
  | (?P<directive>%[a-z]+)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z_0-9]*(\.[A-Za-z_][A-Za-z_0-9]*)*)
  | (?P<space>[ \t]+)
  | (?P<newline>\r?\n)
  | (?P<other>->|\.\.|[:|()\[\]*+?~{},]|\d+)
""", re.VERBOSE)

# lark's common.lark, as far as grammars import it
_COMMON = {
    "DIGIT": "/[0-9]/", "HEXDIGIT": "/[a-fA-F0-9]/", "INT": "/[0-9]+/", "SIGNED_INT": "/[+-]?[0-9]+/",
    "DECIMAL": r"/[0-9]+\.[0-9]*|\.[0-9]+/", "FLOAT": r"/([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+/",
    "NUMBER": r"/[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?/",
    "SIGNED_NUMBER": r"/[+-]?([0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?)/",
    "LETTER": "/[a-zA-Z]/", "UCASE_LETTER": "/[A-Z]/", "LCASE_LETTER": "/[a-z]/", "WORD": "/[a-zA-Z]+/",
    "CNAME": "/[_a-zA-Z][_a-zA-Z0-9]*/", "ESCAPED_STRING": r'/"(\\.|[^"\\])*"/',
    "WS_INLINE": r"/[ \t]+/", "WS": r"/[ \t\f\r\n]+/", "CR": r"/\r/", "LF": r"/\n/", "NEWLINE": r"/(\r?\n)+/",
}


def freeform_rules(freeform: Freeform, prefix: str, quoted: bool) -> tuple[list[str], str]:
    """(Lark rules, the name of their start rule) for a freeform input, raw or JSON-quoted. Raw text
    of any kind has no rules: the call syntax's own raw text ends it. ValueError for a grammar that
    cannot be read or rewritten."""
    start = f"{prefix}_start"
    if freeform.syntax == "text":
        if not quoted:
            raise ValueError("raw text of any kind is the call syntax's own: it has no rules")
        return [f"{start}: {_QuotedRegex(re.DOTALL).sequence(_sre_parse.parse('.*', re.DOTALL))}"], start
    source = freeform.definition
    if freeform.syntax == "regex":
        source = "start: /" + re.sub(r"(?<!\\)/", r"\\/", source) + "/"
    return _Rewriter(prefix, quoted).rules(source), start


def regex_literal(text: str) -> str:
    """`text` matched literally inside /.../ (Rust regex; < and > must stay unescaped)."""
    return "".join(_regex_char(char) for char in text)


def _regex_char(char: str) -> str:
    if char in _REGEX_META:
        return "\\" + char
    if ord(char) < 0x20 or char == "\x7f":
        return f"\\x{{{ord(char):x}}}"
    return char


class _Rewriter:
    def __init__(self, prefix: str, quoted: bool):
        self._prefix, self._quoted = prefix, quoted

    def rules(self, source: str) -> list[str]:
        out: list[str] = []
        line: list[str] = []
        tokens = self._tokens(source)
        i = 0
        while i < len(tokens):
            kind, text = tokens[i]
            if kind == "newline":
                out.append("".join(line))
                line = []
            elif kind == "directive" and text == "%import":
                i = self._import(tokens, i + 1, out)
                continue
            elif kind == "directive" and (text != "%ignore" or self._quoted):
                raise ValueError(f"{text} is not supported in a custom tool's grammar")
            elif kind == "other" and text == "->":  # an alias: drop it and its name
                i += 1
                while i < len(tokens) and tokens[i][0] in ("space", "name"):
                    i += 1
                continue
            elif kind == "string" and i + 2 < len(tokens) and tokens[i + 1][1] == "..":  # "a".."z"
                line.append(self._range(text, tokens[i + 2][1]))
                i += 3
                continue
            else:
                line.append(self._token(kind, text))
            i += 1
        out.append("".join(line))
        return [rule for rule in out if rule.strip()]

    def _tokens(self, source: str) -> list[tuple[str, str]]:
        tokens, position = [], 0
        while position < len(source):
            match = _TOKEN.match(source, position)
            if match is None:
                raise ValueError(f"cannot read the grammar at {source[position:position + 20]!r}")
            position = match.end()
            if match.lastgroup != "comment":
                tokens.append((match.lastgroup or "", match.group()))
        return tokens

    def _import(self, tokens: list[tuple[str, str]], i: int, out: list[str]) -> int:
        """`%import common.X` or `%import common (X, Y)`: the terminals written out under the prefix."""
        names = []
        while i < len(tokens) and tokens[i][0] != "newline":
            kind, text = tokens[i]
            if kind == "name":
                names.append(text)
            i += 1
        if names and names[0] == "common":
            names = names[1:]
        for name in names:
            terminal = name.removeprefix("common.")
            if terminal not in _COMMON:
                raise ValueError(f"%import {name}: only lark's common terminals can be imported "
                                 f"({', '.join(sorted(_COMMON))})")
            out.append(f"{self._name(terminal)}: {self._regex(_COMMON[terminal])}")
        return i

    def _token(self, kind: str, text: str) -> str:
        if kind == "name":
            return self._name(text)
        if kind == "string":
            return self._string(text)
        if kind == "regex":
            return self._regex(text)
        return text

    def _name(self, name: str) -> str:
        marker = name[0] if name[0] in "?!" else ""
        name = name[len(marker):]
        if not (name.isupper() or (name[0] == "_" and name[1:].isupper())):
            return f"{marker}{self._prefix}_{name}"
        # quoted, a terminal is a rule: its escapes are lexemes of their own
        return f"{marker}{self._prefix}_t{name.lower()}" if self._quoted else f"{marker}{self._prefix.upper()}_{name}"

    def _string(self, text: str) -> str:
        insensitive = text.endswith("i")
        value = ast.literal_eval(text[:-1] if insensitive else text)
        if not self._quoted:
            return text
        if insensitive:
            return "/" + "".join(_case_class(char) if char.isalpha() else regex_literal(_escaped(char))
                                 for char in value) + "/"
        return _lark_string(_escaped(value))

    def _range(self, low: str, high: str) -> str:
        first, last = ast.literal_eval(low), ast.literal_eval(high)
        return self._regex(f"/[{regex_literal(first)}-{regex_literal(last)}]/")

    def _regex(self, text: str) -> str:
        if not self._quoted:
            return text
        body, flags = text[1:].rsplit("/", 1)
        mode = (re.IGNORECASE if "i" in flags else 0) | (re.DOTALL if "s" in flags else 0) | \
            (re.MULTILINE if "m" in flags else 0) | (re.VERBOSE if "x" in flags else 0)
        try:
            parsed = _sre_parse.parse(body.replace("\\/", "/"), mode)
        except re.error as error:
            raise ValueError(f"regex /{body}/: {error}") from None
        expression = _QuotedRegex(mode).sequence(parsed)
        if not expression:
            raise ValueError(f"regex /{body}/ matches only the empty text")
        return f"({expression})"


def _case_class(char: str) -> str:
    return f"[{char.lower()}{char.upper()}]"


class _QuotedRegex:
    """A parsed regex written out again as a Lark expression matching the JSON-escaped text of what it
    matched. Not one lexeme: llguidance's lexer looks one byte ahead, so a lexeme that may go on with
    `\\"` could not end before a `\\n` that follows it. Runs of plain characters are lexemes; each escape
    is a lexeme of its own."""

    def __init__(self, mode: int):
        self._mode = mode

    def sequence(self, pattern: list) -> str:
        return " ".join(part for part in (self._node(op, value) for op, value in pattern) if part)

    def _node(self, op: object, value: object) -> str:  # noqa: PLR0911 - one return per node kind
        if op is _sre.LITERAL:
            return self._char(chr(value))
        if op in (_sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.CATEGORY):
            return self._set(op, value, "")
        if op is _sre.BRANCH:
            branches = [self.sequence(branch) for branch in value[1]]
            alternatives = " | ".join(branch for branch in branches if branch)
            return f"({alternatives})" + ("?" if not all(branches) else "") if alternatives else ""
        if op is _sre.SUBPATTERN:
            inner = self.sequence(value[-1])
            return f"({inner})" if inner else ""
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None)):
            return self._repeat(*value)
        if op is _sre.AT:  # anchors: the terminal is matched whole anyway
            return ""
        raise ValueError(f"regex feature {op} is not supported in a JSON-quoted custom tool grammar")

    def _repeat(self, low: int, high: int, item: list) -> str:
        unbounded = high == _sre.MAXREPEAT
        if unbounded and low <= 1 and len(item) == 1 and item[0][0] in (_sre.NOT_LITERAL, _sre.ANY, _sre.IN,
                                                                          _sre.CATEGORY):
            return self._set(*item[0], "+" if low else "*")  # a run of plain characters is one lexeme
        inner = self.sequence(item)
        if not inner:
            return ""
        quantifier = {(0, True): "*", (1, True): "+"}.get((low, unbounded)) or \
            ("?" if (low, high) == (0, 1) else f"{{{low},{'' if unbounded else high}}}")
        return f"({inner}){quantifier}"

    def _char(self, char: str) -> str:
        if char in _JSON_SPECIAL:
            return _lark_string(_escaped(char))
        if self._mode & re.IGNORECASE and char.isalpha():
            return f"/{_case_class(char)}/"
        return _lark_string(char)

    def _set(self, op: object, value: object, repeat: str) -> str:
        """A character set, once ("") or repeated ("*", "+"): plain characters, or one of the escapes
        of the JSON specials it holds."""
        if op is _sre.NOT_LITERAL:
            class_text, matches = f"[^{_regex_char(chr(value))}]", lambda char: char != chr(value)
        elif op is _sre.ANY:
            dotall = bool(self._mode & re.DOTALL)
            class_text, matches = ("[\\s\\S]" if dotall else "[^\\n]"), lambda char: dotall or char != "\n"
        else:
            items = value if op is _sre.IN else [(op, value)]
            class_text, matches = _class_text(items), lambda char: _in_class(char, items)
        plain = f"[{class_text}&&{_PLAIN}]" + ("+" if repeat else "")
        plain = f"(?i:{plain})" if self._mode & re.IGNORECASE else plain
        escapes = [_lark_string(_escaped(char)) for char in _JSON_SPECIAL if matches(char)]
        return "(" + " | ".join([f"/{plain}/"] + escapes) + ")" + repeat


def _escaped(text: str) -> str:
    """`text` as JSON writes it inside a string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


_CATEGORIES = {
    _sre.CATEGORY_DIGIT: "\\d", _sre.CATEGORY_NOT_DIGIT: "\\D", _sre.CATEGORY_SPACE: "\\s",
    _sre.CATEGORY_NOT_SPACE: "\\S", _sre.CATEGORY_WORD: "\\w", _sre.CATEGORY_NOT_WORD: "\\W",
}
_CATEGORY_TESTS = {
    _sre.CATEGORY_DIGIT: str.isdigit, _sre.CATEGORY_NOT_DIGIT: lambda c: not c.isdigit(),
    _sre.CATEGORY_SPACE: str.isspace, _sre.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
    _sre.CATEGORY_WORD: lambda c: c.isalnum() or c == "_", _sre.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
}


def _class_text(items: list) -> str:
    negate, parts = False, []
    for op, value in items:
        if op is _sre.NEGATE:
            negate = True
        elif op is _sre.LITERAL:
            parts.append(_regex_char(chr(value)))
        elif op is _sre.RANGE:
            parts.append(f"{_regex_char(chr(value[0]))}-{_regex_char(chr(value[1]))}")
        elif op is _sre.CATEGORY and value in _CATEGORIES:
            parts.append(_CATEGORIES[value])
        else:
            raise ValueError(f"character class item {op} is not supported")
    return "[" + ("^" if negate else "") + "".join(parts) + "]"


def _in_class(char: str, items: list) -> bool:
    negate, hit = False, False
    for op, value in items:
        if op is _sre.NEGATE:
            negate = True
        elif op is _sre.LITERAL:
            hit |= ord(char) == value
        elif op is _sre.RANGE:
            hit |= value[0] <= ord(char) <= value[1]
        elif op is _sre.CATEGORY:
            hit |= _CATEGORY_TESTS[value](char)
    return hit != negate
