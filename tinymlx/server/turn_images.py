"""The server's part in a turn's images, around the engine's (engine/image_intake.py): before the prompt is made,
each http(s) image URL is fetched into its ImageData; after, a text-only model's omitted images are logged and
counted. A text model's images are never fetched: they become a note, or under --images refuse a 400 naming
the request's part (the wire format's own name for it, which the engine cannot know)."""

from __future__ import annotations

import logging
from dataclasses import replace

from prometheus_client import Counter

from tinymlx.core.config import EngineConfig
from tinymlx.core.images import ImageData
from tinymlx.server.image_fetch import ImageFetcher
from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import ChatTurn, Message

log = logging.getLogger("tinymlx.server")


class TurnImages:
    def __init__(self, sees_images: bool, config: EngineConfig, fetcher: ImageFetcher, omitted: Counter):
        """`omitted`: the /metrics counter of images a text-only model got as a note."""
        self.sees_images, self.config, self.fetcher, self.omitted = sees_images, config, fetcher, omitted

    async def fetched(self, turn: ChatTurn) -> ChatTurn:
        """The turn with every image URL's bytes fetched (within what --max-image-bytes leaves)."""
        images = _images(turn)
        if not images:
            return turn
        if not self.sees_images:
            if self.config.images == "refuse":
                raise APIError(400, f"{images[0].where}: this model reads text only and cannot take images",
                               images[0].where, "invalid_image")
            return turn
        if len(images) > self.config.max_images_per_request:  # before fetching any of them
            raise APIError(400, f"{images[-1].where}: {len(images)} images in one request; at most "
                                f"{self.config.max_images_per_request} (--max-images-per-request)",
                           images[-1].where, "invalid_image")
        if not any(image.url for image in images):
            return turn
        budget = self.config.max_image_bytes - sum(len(image.data) for image in images)
        messages: list[Message] = []
        for message in turn.messages:
            parts = []
            for part in message.parts:
                if isinstance(part, ImageData) and part.url:
                    part = ImageData(await self.fetcher.fetch(part.url, part.where, max(budget, 0)), part.where)
                    budget -= len(part.data)
                parts.append(part)
            messages.append(replace(message, parts=tuple(parts)) if parts else message)
        return replace(turn, messages=tuple(messages))

    def note_omitted(self, turn: ChatTurn, endpoint: str) -> None:
        """A text model got a note for each image (the engine wrote it): one log line, and the counter."""
        if self.sees_images:
            return
        num_images = len(_images(turn))
        if num_images:
            self.omitted.inc(num_images)
            log.info("%s: %d image%s omitted (a note in %s place): this model reads text only", endpoint,
                     num_images, "s" * (num_images > 1), "their" if num_images > 1 else "its")


def _images(turn: ChatTurn) -> list[ImageData]:
    return [part for message in turn.messages for part in message.parts if isinstance(part, ImageData)]
