"""ChatSession: one conversation and its settings, and the messages the engine is sent each turn."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinymlx.sampling_params import SamplingParams

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
NEW_TITLE = "New chat"


@dataclass(frozen=True)
class SessionSettings:
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    temperature: float = 0.7
    max_tokens: int = 512
    json_output: bool = False  # replies constrained to a JSON object

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError for settings the engine would refuse (the settings screen shows it)."""
        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, json_object=self.json_output)


@dataclass
class ChatSession:
    session_id: int
    title: str = NEW_TITLE
    settings: SessionSettings = field(default_factory=SessionSettings)
    turns: list[dict[str, str]] = field(default_factory=list)  # user/assistant, oldest first

    def prompt_messages(self) -> list[dict[str, str]]:
        """The whole conversation, system prompt first, so turn 1's tokens are a prefix of turn 2's
        and the engine's prefix cache serves them again."""
        system = [{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else []
        return system + self.turns

    def request_id(self, nonce: str) -> str:
        return f"session-{self.session_id}-{nonce}"


def session_of_request(request_id: str) -> int | None:
    """Inverse of ChatSession.request_id; None for requests the UI did not send."""
    parts = request_id.split("-")
    if len(parts) == 3 and parts[0] == "session" and parts[1].isdigit():
        return int(parts[1])
    return None


def title_from(text: str, width: int = 24) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"
