"""The markup of the three call syntaxes: the tags a call is written between, and the patterns
that read a call's parts.

    hermes  <tool_call>\\n{"name": "fn", "arguments": {...}}\\n</tool_call>          Qwen2.5, Qwen3
    xml     <tool_call>\\n<function=fn>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n</tool_call>
                                                                              Qwen3-Coder, Qwen3.5
    llama3  {"name": "fn", "parameters": {...}}; {...}    the whole reply (after <|python_tag|>)

An untagged hermes call (tool_choice "auto" only) is the hermes call's JSON without the tags, as the
whole reply, bare or fenced: ```json\\n{"name": "fn", "arguments": {...}}\\n```    Qwen2.5-Coder
"""

from __future__ import annotations

import re

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PARAMETER_CLOSE = "</parameter>"
# An untagged call opens with one of these fences or none; after it the fence closes on its own line.
UNTAGGED_FENCES, UNTAGGED_FENCE_CLOSE = ("```json\n", "```\n"), "```"
UNTAGGED_KEY = '"name"'  # the reply's start is an untagged call once `{"name"` is read
# {"name": "fn", "arguments": ...}: the call can start once its name and the arguments' key are read.
JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
