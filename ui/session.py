"""ChatSession: one conversation and its settings, and the messages the engine is sent each turn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tinymlx.core.sampling_params import SamplingParams
from tinymlx.engine.image_intake import IMAGE_NOTE

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
NEW_TITLE = "New chat"


@dataclass(frozen=True)
class SessionSettings:
    """What the F2 screen edits. The first four fields keep their positions (older code builds these positionally);
    the sampling fields mirror SamplingParams' names and defaults, so SamplingParams validates them."""

    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    temperature: float = 0.7
    max_tokens: int = 512
    json_output: bool = False  # replies constrained to a JSON object
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError for settings the engine would refuse (the settings screen shows it)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, max_tokens=self.max_tokens, stop=self.stop,
            json_object=self.json_output,
        )


@dataclass
class ChatSession:
    session_id: int
    title: str = NEW_TITLE
    settings: SessionSettings = field(default_factory=SessionSettings)
    # user/assistant, oldest first; a reply may also carry "note" (cut off) and "stats" (its numbers), a user
    # turn "images" (a tuple of Attachment)
    turns: list[dict[str, Any]] = field(default_factory=list)

    def prompt(self, chat: bool = True) -> list[dict[str, Any]] | str:
        """What the engine gets: the messages, for the model's chat template; with no template (a base
        model), the conversation as one text it continues: system prompt, then each turn's text. A reply
        continues exactly the text before it; a typed turn gets a space before it where neither side has
        one (the prompt box trims what is typed)."""
        if chat:
            return self.prompt_messages()
        text = ""
        for turn in self._system_turn() + self.turns:
            # No template, no image tokens to place: a base model reads the note a text model gets.
            content = turn["content"] + "".join(f" {IMAGE_NOTE}" for _ in turn.get("images", ()))
            typed = turn["role"] != "assistant"
            if typed and text and content and not (text[-1].isspace() or content[0].isspace()):
                text += " "
            text += content
        return text

    def prompt_messages(self, with_images: bool = True) -> list[dict[str, Any]]:
        """The whole conversation, system prompt first, so turn 1's tokens are a prefix of turn 2's
        and the engine's prefix cache serves them again (images too: the same bytes every turn)."""
        return self._system_turn() + [_message(turn, with_images) for turn in self.turns]

    def _system_turn(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else []

    def request_id(self, nonce: str) -> str:
        return f"session-{self.session_id}-{nonce}"


def _message(turn: dict[str, Any], with_images: bool = True) -> dict[str, Any]:
    """A turn as the engine reads it: plain text, or, with images, content parts (text first, then each image).
    A turn without images keeps its plain string, so the prompts of existing sessions stay the same."""
    images = turn.get("images") if with_images else None
    if not images:
        return {"role": turn["role"], "content": turn["content"]}
    parts = [{"type": "text", "text": turn["content"]}, *({"type": "image", "image": image.data} for image in images)]
    return {"role": turn["role"], "content": parts}


def session_of_request(request_id: str) -> int | None:
    """Inverse of ChatSession.request_id; None for requests the UI did not send."""
    parts = request_id.split("-")
    if len(parts) == 3 and parts[0] == "session" and parts[1].isdigit():
        return int(parts[1])
    return None


def title_from(text: str, width: int = 24) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"
