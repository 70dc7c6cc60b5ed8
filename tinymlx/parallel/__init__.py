"""Tensor parallelism over mx.distributed (sharded linears, the rank group, the step broadcast, worker launch) and
pipeline parallelism over TCP links (stages, their workers, the hand-offs between them)."""

from tinymlx.parallel.launch import ParallelError, TensorParallelError
from tinymlx.parallel.rank_group import RankGroup

__all__ = ["ParallelError", "RankGroup", "TensorParallelError"]
