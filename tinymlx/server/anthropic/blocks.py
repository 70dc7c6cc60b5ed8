"""Anthropic's content blocks -> Messages, the same way every turn, so an earlier turn re-renders
byte-identically: tool_use -> the assistant's tool_calls (input as json.dumps), thinking -> its
reasoning, tool_result -> a "tool" message named after the call it answers, placed before the user's
text. Image blocks (a base64 or url source) sit in a user turn or a tool_result's content, where Claude Code
puts screenshots and the PNGs its Read tool opens: they become the Message's parts, in order. Documents are
refused by name.

A tool_result may hold tool_reference blocks (Anthropic's tool search: Claude Code's ToolSearch answers
with them). Each becomes a line of the result's text: a deferred tool's definition, which loads it (it
becomes callable, see ChatTurn.loaded_tools), or a note that a listed tool is loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel

from tinymlx.core.images import ImageData
from tinymlx.server.image_parts import image_of_base64, image_of_url
from tinymlx.server.strict_model import StrictModel, short_repr, validated
from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import Message, Tool, ToolCall, message_content

# Claude Code's first system block carries a per-request nonce (cch=...): kept, it would make every
# turn's prompt new from its first tokens and the prefix cache would never hit.
_BILLING_HEADER = "x-anthropic-billing-header:"


class MessageParam(StrictModel):
    role: Literal["user", "assistant", "system"]  # Claude Code puts a system message mid-conversation
    content: Any  # a string or blocks, checked block by block so an error names the block


class _TextBlock(StrictModel):
    type: Literal["text"]
    text: str


class _ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str


class _RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]  # Anthropic's encrypted thinking: nothing a template can show
    data: str


class _ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class _ImageBlock(StrictModel):
    type: Literal["image"]
    source: dict[str, Any]  # read by its own type below, so an error names source's field


class _Base64Source(StrictModel):
    type: Literal["base64"]
    media_type: str
    data: str


class _UrlSource(StrictModel):
    type: Literal["url"]
    url: str


class _ToolReferenceBlock(StrictModel):
    type: Literal["tool_reference"]
    tool_name: str


@dataclass
class ToolSearch:
    """The request's tools by name, for the tool_reference blocks of its tool results: `listed` are in the
    prompt's tool list, `deferred` (defer_loading) are not; `loaded` collects the deferred ones referenced."""

    listed: frozenset[str] = frozenset()
    deferred: dict[str, Tool] = field(default_factory=dict)
    loaded: list[Tool] = field(default_factory=list)

    def reference(self, name: str, where: str) -> str:
        """A tool_reference's text in the tool result."""
        tool = self.deferred.get(name)
        if tool is not None:
            if tool not in self.loaded:
                self.loaded.append(tool)
            return json.dumps({"name": tool.name, "description": tool.description, "input_schema": tool.parameters},
                              ensure_ascii=False)
        if name in self.listed:
            return f"Tool loaded: {name}"
        raise APIError(400, f"{where}.tool_name: {name!r} is none of the request's tools", f"{where}.tool_name")


class _ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Any = ""  # a string, or text, image and tool_reference blocks
    is_error: bool = False  # templates have no place for it; clients put the error in the content


_BLOCKS = {"text": _TextBlock, "thinking": _ThinkingBlock, "redacted_thinking": _RedactedThinkingBlock,
           "tool_use": _ToolUseBlock, "tool_result": _ToolResultBlock, "image": _ImageBlock}
_ROLE_BLOCKS = {"user": ("text", "image", "tool_result"), "assistant": ("text", "thinking", "redacted_thinking", "tool_use"),
                "system": ("text",)}


def system_messages(system: Any) -> list[Message]:
    """`system` (a string or text blocks) as the one leading system Message, or none."""
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        texts = (_text_block(block, f"system[{i}]").text for i, block in enumerate(system))
        text = "\n".join(t for t in texts if not t.startswith(_BILLING_HEADER))
    else:
        raise APIError(400, "system must be a string or a list of text blocks", "system")
    return [Message("system", text)] if text else []


def turn_messages(params: list[MessageParam], tool_search: ToolSearch | None = None) -> list[Message]:
    """`messages` as Messages: a user turn's tool_results first, then its text; a system message where it
    stands (the chat template renders it there). `tool_search` reads the tool results' tool_references."""
    tool_search = tool_search or ToolSearch()
    messages: list[Message] = []
    names: dict[str, str] = {}  # tool_use id -> its tool's name, from the turns so far
    for i, param in enumerate(params):
        where = f"messages[{i}].content"
        blocks = _blocks(param.content, param.role, where)
        if param.role == "system":
            messages.append(Message("system", "\n".join(b.text for b in blocks)))
            continue
        if param.role == "assistant":
            calls = tuple(ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                          for b in blocks if isinstance(b, _ToolUseBlock))
            names.update((call.id, call.name) for call in calls)
            thinking = [b.thinking for b in blocks if isinstance(b, _ThinkingBlock)]
            # Our replies' text blocks are pieces of one generated text: they join back with nothing between.
            messages.append(Message("assistant", "".join(b.text for b in blocks if isinstance(b, _TextBlock)),
                                    "".join(thinking) if thinking else None, calls))
            continue
        results, items = [], []
        for j, block in enumerate(blocks):
            if isinstance(block, _ToolResultBlock):
                if block.tool_use_id not in names:
                    raise APIError(400, f"{where}[{j}].tool_use_id {block.tool_use_id!r} answers no earlier "
                                        "tool_use block", f"{where}[{j}].tool_use_id")
                parts = _result_parts(block.content, f"{where}[{j}].content", tool_search)
                results.append(Message("tool", **message_content(_lines(parts)), tool_call_id=block.tool_use_id,
                                       name=names[block.tool_use_id]))
            elif isinstance(block, _ImageBlock):
                items.append(_image(block, f"{where}[{j}]"))
            elif isinstance(block, _TextBlock):
                items.append(block.text)
        content = message_content(_lines(items))
        messages += results + ([Message("user", **content)] if content["content"] or content["parts"] or not results
                               else [])
    return messages


def without_old_thinking(messages: list[Message], keep: int) -> list[Message]:
    """The conversation with the thinking of all but the last `keep` thinking turns dropped (clear_thinking)."""
    thinking = [i for i, message in enumerate(messages) if message.role == "assistant" and message.reasoning]
    dropped = set(thinking[:len(thinking) - keep] if keep else thinking)
    return [replace(message, reasoning=None) if i in dropped else message for i, message in enumerate(messages)]


def _blocks(content: Any, role: str, where: str) -> list[BaseModel]:
    if isinstance(content, str):
        return [_TextBlock(type="text", text=content)]
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", where)
    blocks = []
    for j, block in enumerate(content):
        kind = _kind(block, f"{where}[{j}]")
        if kind not in _ROLE_BLOCKS[role]:
            raise APIError(400, f"{where}[{j}].type: blocks of role {role!r} must be "
                                f"{', '.join(_ROLE_BLOCKS[role])}; got {kind!r}", f"{where}[{j}].type")
        blocks.append(validated(_BLOCKS[kind], block, f"{where}[{j}]", shown=short_repr))
    return blocks


def _result_parts(content: Any, where: str, tool_search: ToolSearch) -> list[str | ImageData]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text, image and tool_reference blocks", where)
    parts: list[str | ImageData] = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_reference":
            reference = validated(_ToolReferenceBlock, block, f"{where}[{k}]", shown=short_repr)
            parts.append(tool_search.reference(reference.tool_name, f"{where}[{k}]"))
        elif kind == "image":
            parts.append(_image(validated(_ImageBlock, block, f"{where}[{k}]", shown=short_repr), f"{where}[{k}]"))
        else:
            parts.append(_text_block(block, f"{where}[{k}]").text)
    return parts


def _lines(items: list[str | ImageData]) -> list[str | ImageData]:
    """Blocks as a Message's parts: text blocks joined by newlines (as a text-only turn always was), each image
    standing where it was sent."""
    parts: list[str | ImageData] = []
    for item in items:
        if parts and isinstance(item, str) and isinstance(parts[-1], str):
            parts[-1] += "\n" + item
        else:
            parts.append(item)
    return parts


def _image(block: _ImageBlock, where: str) -> ImageData:
    kind = block.source.get("type")
    if kind == "base64":
        source = validated(_Base64Source, block.source, f"{where}.source", shown=short_repr)
        return image_of_base64(source.data, source.media_type, where)
    if kind == "url":
        return image_of_url(validated(_UrlSource, block.source, f"{where}.source", shown=short_repr).url, where)
    raise APIError(400, f"{where}.source.type must be 'base64' or 'url', got {kind!r}", f"{where}.source.type")


def _text_block(block: Any, where: str) -> _TextBlock:
    """A block where only text blocks are allowed."""
    if _kind(block, where) != "text":
        raise APIError(400, f"{where}.type: only text blocks are allowed here, got {block.get('type')!r}",
                       f"{where}.type")
    return validated(_TextBlock, block, where, shown=short_repr)


def _kind(block: Any, where: str) -> Any:
    """The block's type; documents are refused by name (send their text)."""
    if not isinstance(block, dict):
        raise APIError(400, f"{where} must be a content block object", where)
    kind = block.get("type")
    if kind == "document":
        raise APIError(400, f"{where}.type: documents are not supported; send their text", f"{where}.type")
    return kind
