"""tinymlx: a small, fully-understood LLM inference engine for MLX."""

from tinymlx.config import EngineConfig
from tinymlx.engine import Engine
from tinymlx.llm import LLM
from tinymlx.outputs import EngineStats, RequestOutput
from tinymlx.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
