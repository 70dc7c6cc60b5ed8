"""tinymlx: a small, fully-understood LLM inference engine for MLX."""

import time

# When tinymlx began to import (before MLX and the rest): `tinymlx chat` reports its start-up from here.
STARTED_AT = time.monotonic()

from tinymlx.core.config import EngineConfig  # noqa: E402
from tinymlx.core.outputs import EngineStats, RequestOutput  # noqa: E402
from tinymlx.core.sampling_params import SamplingParams  # noqa: E402
from tinymlx.engine.async_engine import AsyncEngine  # noqa: E402
from tinymlx.engine.engine import Engine  # noqa: E402
from tinymlx.engine.llm import LLM  # noqa: E402

__all__ = ["LLM", "AsyncEngine", "Engine", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
