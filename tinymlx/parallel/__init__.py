"""Tensor parallelism over mx.distributed: sharded linears, the rank group, the step broadcast, worker launch."""

from tinymlx.parallel.launch import TensorParallelError
from tinymlx.parallel.rank_group import RankGroup

__all__ = ["RankGroup", "TensorParallelError"]
