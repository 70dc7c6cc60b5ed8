"""The names a server answers to: vLLM's `--served-model-name A B ...`. The first is the one replies and
/v1/models carry; the others are aliases (an agent CLI configured with another name still gets served)."""

from __future__ import annotations

from typing import NamedTuple

from tinymlx.turns.api_error import APIError


class ServedModels(NamedTuple):
    names: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.names[0]

    def check(self, model: str) -> None:
        """A 404 naming what is served, for a request naming anything else."""
        if model not in self.names:
            served = " or ".join(repr(name) for name in self.names)
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", "model",
                           "model_not_found")
