"""StatusBar: which model runs where, in which dtype, over how big a KV pool."""

from __future__ import annotations

from dataclasses import dataclass

from textual.widgets import Static


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    device: str
    dtype: str
    num_blocks: int
    block_size: int
    tensor_parallel_size: int = 1


class StatusBar(Static):
    def __init__(self, info: EngineInfo, **kwargs) -> None:
        text = (f" {info.model_name}  ·  device {info.device}  ·  dtype {info.dtype}  ·  "
                f"KV pool {info.num_blocks} blocks × {info.block_size} tokens")
        if info.tensor_parallel_size > 1:
            text += f"  ·  TP {info.tensor_parallel_size} ranks"
        super().__init__(text, markup=False, **kwargs)
