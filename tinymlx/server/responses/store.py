"""The Responses API's stored responses, for previous_response_id and GET /v1/responses/{id}: an LRU
bounded to `size` (0 stores none). Each keeps its whole conversation, its input (a previous_response_id
expanded) and its output as one assistant Message, so a chain re-renders every earlier turn the same
bytes and turn k+1's prompt reuses turn k's blocks in the prefix cache."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, NamedTuple

from tinymlx.server.responses.body import ResponsesTurnRequest
from tinymlx.turns.turn import Message, TurnRequest, TurnResult


class _Stored(NamedTuple):
    conversation: tuple[Message, ...]
    body: dict[str, Any]


class ResponseStore:
    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[str, _Stored] = OrderedDict()  # LRU: the most recently used last

    def keep(self, response_id: str, request: TurnRequest, result: TurnResult, body: dict[str, Any]) -> None:
        """Stores the finished Response when its request asked for it."""
        history, store = _context(request)
        if store and self.size > 0:
            reply = Message("assistant", result.text, result.reasoning, tuple(result.tool_calls))
            self._entries[response_id] = _Stored(history + (reply,), copy.deepcopy(body))
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def conversation(self, response_id: str) -> tuple[Message, ...] | None:
        """The conversation a response chained on it inherits; None: unknown, evicted or not stored."""
        if response_id not in self._entries:
            return None
        self._entries.move_to_end(response_id)
        return self._entries[response_id].conversation

    def get(self, response_id: str) -> dict[str, Any] | None:
        """A copy of the stored Response; None: unknown, evicted or sent with store false."""
        if response_id not in self._entries:
            return None
        self._entries.move_to_end(response_id)
        return copy.deepcopy(self._entries[response_id].body)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


def _context(request: TurnRequest) -> tuple[tuple[Message, ...], bool]:
    """(the conversation a chained response inherits, whether to store): a plain TurnRequest keeps all."""
    if isinstance(request, ResponsesTurnRequest):
        return request.history, request.store
    return request.turn.messages, True
