"""ServerConfig: how `tinymlx serve` answers, frozen (the engine's own settings are EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...] = ()  # the first is what replies carry, the rest aliases; (): the engine's
    api_key: str | None = None  # every endpoint but /health then wants "Authorization: Bearer <key>" or x-api-key
    max_queue: int = 256  # admitted choices without a first token yet; more are refused (503)
    queue_timeout_s: float | None = None  # longest wait for a choice's first token
    request_timeout_s: float | None = None  # longest whole request
    retry_after_s: int = 1
    drain_timeout_s: float = 30.0  # on shutdown, how long streams in flight may still run
    otel: bool = False
    tool_call_parser: str | None = None  # hermes | xml | llama3; None: read from the chat template
    responses_store_size: int = 256  # stored /v1/responses replies, for previous_response_id
    # http(s) image URLs a request names (server/image_fetch.py): the longest fetch of one, redirects included,
    # and whether private, loopback and link-local addresses may be fetched (off: a request cannot make the
    # server probe the network it sits in).
    image_fetch_timeout_s: float = 10.0
    allow_private_image_urls: bool = False
