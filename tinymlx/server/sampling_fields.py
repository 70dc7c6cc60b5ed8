"""The sampling fields the chat/completions and Responses bodies share: OpenAI's, and vLLM's beyond them,
under the names SamplingParams takes (the Messages API has its own few)."""

from __future__ import annotations

from tinymlx.server.strict_model import StrictModel


class SamplingFields(StrictModel):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None

    def sampling_values(self) -> dict[str, object]:
        """The fields the request set, as SamplingParams' keyword arguments."""
        return {name: getattr(self, name) for name in SamplingFields.model_fields if getattr(self, name) is not None}
