"""Pipeline stages: which contiguous decoder layers each stage runs, balanced by what each layer costs.

A stage's cost is its layers' bytes (weights, and the K/V or state its kind of layer keeps) plus what sits at
either end of the pipeline: the embedding before the first layer, the final norm and the head after the
last. The split minimises the largest stage's cost, since the slowest (or fullest) stage sets the
pipeline's pace and the memory each machine must have; every stage gets at least one layer.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def split_layers(layer_costs: Sequence[int], num_stages: int, first_extra: int = 0,
                 last_extra: int = 0, cuts: Collection[int] | None = None) -> tuple[range, ...]:
    """Contiguous ranges of layer indices, one per stage in pipeline order, covering every layer: the split
    whose costliest stage costs least, `first_extra` counted on the first stage and `last_extra` on the last.
    `cuts`: the layers a stage may start at (None: any), where layers must stay together (a KV-shared layer
    with the layer whose K/V it reads). ValueError when there are fewer layers than stages, or too few cuts."""
    num_layers = len(layer_costs)
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} decoder layers cannot fill {num_stages} pipeline stages: each stage runs "
                         f"at least one layer (pipeline_parallel_size at most {num_layers})")
    prefix = [0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)

    def cost(stage: int, start: int, end: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == num_stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    # best[s][e]: the least costliest-stage cost of layers [0, e) over stages 0..s; cut[s][e]: stage s's start.
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for end in range(1, num_layers + 1):
        best[0][end] = cost(0, 0, end)
    for stage in range(1, num_stages):
        for end in range(stage + 1, num_layers + 1):
            for start in range(stage, end):
                if cuts is not None and start not in cuts:
                    continue
                worst = max(best[stage - 1][start], cost(stage, start, end))
                if worst < best[stage][end]:
                    best[stage][end], cut[stage][end] = worst, start
    if best[num_stages - 1][num_layers] == inf:
        raise ValueError(f"{num_layers} decoder layers cannot be split into {num_stages} pipeline stages that keep "
                         f"every KV-shared layer with the layer whose K/V it reads (a stage may start at layers "
                         f"{sorted(cuts)}): use fewer stages")
    ranges, end = [], num_layers
    for stage in range(num_stages - 1, -1, -1):
        start = cut[stage][end] if stage else 0
        ranges.append(range(start, end))
        end = start
    return tuple(reversed(ranges))
