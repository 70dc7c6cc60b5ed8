"""Prefill after a cached context: what an agent's turn 2 pays, and where the time goes.

An agent's later turn computes ~85 new tokens (its call and the tool's result) over a ~2.4k-token cached
prompt (benchmarks/agent_loop.py). This measures that shape alone, on one process and model:
  - TTFT of N new tokens after C cached ones (a one-token reply at temperature 0), tinymlx (the
    context prefilled by an earlier request, reused from the prefix cache) against mlx-lm (the context
    prefilled into a prompt cache, then `stream_generate` on the new tokens with it), for C = 0 and
    larger;
  - tinymlx's attention share of that TTFT: the same request again with each layer's paged attention
    evaluated on its own and timed (the forward's other ops are evaluated before it starts);
  - one layer's attention for one query tile (64 queries over C + 64 keys, the model's heads), op by op:
    the Q.K^T and P.V matmuls, the masked softmax the engine takes (its division comes after P.V; numpy's
    on the CPU, see tinymlx/ops/cpu/), MLX's masked softmax (mx.exp) for comparison, and mx.fast's
    SDPA (the portable path's and mlx-lm's) on the same shapes.
"""

from __future__ import annotations

import copy
import time

import common
import mlx.core as mx
import numpy as np
from matplotlib import pyplot as plt

import tinymlx.kv.kv_cache as kv_cache
from tinymlx.ops import cpu
from tinymlx.ops.attention import unnormalized_softmax

WORKLOADS = {
    "full": {"contexts": [0, 1024, 2368], "new_tokens": 85, "repeats": 2},
    "quick": {"contexts": [0, 256], "new_tokens": 16, "repeats": 1},
}
TILE = 64  # the engine's query tile


def main() -> None:
    args, info, workload, loaded = common.start(__doc__, WORKLOADS)
    ids = common.text_token_ids(loaded.tokenizer)
    n, contexts = workload["new_tokens"], workload["contexts"]
    # Each repeat's new tokens differ (no hit on an earlier repeat's), after the same context.
    suffixes = [ids[9000 + 500 * r: 9000 + 500 * r + n] for r in range(workload["repeats"])]
    common.warm_up(loaded)
    ours = _tinymlx(loaded, ids, contexts, suffixes)
    peer = _mlx_lm(loaded.model_dir, ids, contexts, suffixes)
    args_model = loaded.model.args
    ops = {c: _attention_ops(args_model, c) for c in contexts}

    rows = []
    for c in contexts:
        rows.append([c, n, ours[c]["ttft_s"], ours[c]["attention_s"], ours[c]["attention_s"] / ours[c]["timed_ttft_s"],
                     peer[c]["ttft_s"], ours[c]["ttft_s"] / peer[c]["ttft_s"], 1000 * ours[c]["ttft_s"] / n,
                     1000 * peer[c]["ttft_s"] / n])
    table = common.print_table(f"TTFT of {n} new tokens after C cached ({loaded.model_dir.name}, medians of "
                               f"{workload['repeats']})",
                               ["context C", "new", "tinymlx TTFT s", "attention s", "attention share",
                                "mlx-lm TTFT s", "x mlx-lm", "tinymlx ms/token", "mlx-lm ms/token"], rows)
    op_names = list(next(iter(ops.values())))
    op_table = common.print_table(f"one layer's attention, {TILE} queries over C + {TILE} keys, ms",
                                  ["context C", *op_names], [[c, *ops[c].values()] for c in contexts])
    payload = {"workload": {**workload, "model": loaded.model_dir.name, "tile": TILE}, "tinymlx": ours,
               "mlx_lm": peer, "attention_ops_ms": ops, "table": table, "op_table": op_table}
    # Another model's results go beside the default's: context_prefill_<model>.json
    name = "context_prefill" if args.model is None else f"context_prefill_{args.model.replace('.', '_')}"
    common.save_results(name, args.quick, info, payload, _plot(contexts, ours, peer, ops, n))


# -- tinymlx -------------------------------------------------------------------------------------
def _tinymlx(loaded: common.LoadedModel, ids: list[int], contexts: list[int], suffixes: list[list[int]]) -> dict:
    out = {}
    for c in contexts:
        engine = common.new_engine(loaded)
        context = ids[:c]
        if c:
            common.ttft(engine, context)  # into the prefix cache
        plain = [common.ttft(engine, context + suffix) for suffix in suffixes]
        with _TimedAttention() as spent:
            timed = common.ttft(engine, context + ids[20000:20000 + len(suffixes[0])])
        out[c] = {"ttft_s": float(np.median(plain)), "runs_s": plain, "timed_ttft_s": timed,
                  "attention_s": spent[0]}
        engine.close()
    return out


class _TimedAttention:
    """Within the block, every PagedAttention call is evaluated on its own and its seconds summed."""

    def __enter__(self) -> list[float]:
        self.spent, self.original = [0.0], kv_cache.PagedAttention.__call__
        original, spent = self.original, self.spent

        def timed(attention, layer, q, k, v, scale):
            mx.eval(q, k, v)
            t0 = time.perf_counter()
            result = original(attention, layer, q, k, v, scale)
            mx.eval(result)
            spent[0] += time.perf_counter() - t0
            return result

        kv_cache.PagedAttention.__call__ = timed
        return self.spent

    def __exit__(self, *exc_info) -> None:
        kv_cache.PagedAttention.__call__ = self.original


# -- mlx-lm --------------------------------------------------------------------------------------
def _mlx_lm(model_dir, ids: list[int], contexts: list[int], suffixes: list[list[int]]) -> dict:
    import mlx_lm  # its own loader and forward; imported here only
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = mlx_lm.load(str(model_dir))
    tokenizer.eos_token_ids = set()

    def first_token(prompt: list[int], cache) -> float:
        t0 = time.perf_counter()
        for _ in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=1, prompt_cache=cache):
            break
        return time.perf_counter() - t0

    first_token(ids[5000:5016], make_prompt_cache(model))  # warm-up
    out = {}
    for c in contexts:
        saved = make_prompt_cache(model)
        if c:  # the server's way: the context prefilled once, a copy of that cache per request
            model(mx.array(ids[:c])[None], cache=saved)
            mx.eval([entry.state for entry in saved])
        runs = [first_token(suffix, copy.deepcopy(saved)) for suffix in suffixes]
        out[c] = {"ttft_s": float(np.median(runs)), "runs_s": runs}
    return out


# -- one layer's attention, op by op -------------------------------------------------------------
def _attention_ops(args, context: int, repeats: int = 10) -> dict[str, float]:
    heads, kv_heads, head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    keys = context + TILE
    q = mx.random.normal((1, TILE, heads, head_dim))
    k, v = mx.random.normal((kv_heads, 1, keys, head_dim)), mx.random.normal((kv_heads, 1, keys, head_dim))
    positions = mx.arange(context, keys)
    visible = (mx.arange(keys)[None, :] <= positions[:, None])[None]
    group = heads // kv_heads
    grouped_q = q.reshape(1, TILE, kv_heads, group, head_dim).transpose(2, 0, 3, 1, 4).reshape(
        kv_heads, 1, group * TILE, head_dim)
    scores = (grouped_q @ k.swapaxes(-1, -2)).reshape(kv_heads, 1, group, TILE, keys)
    softmax, _ = cpu.masked_softmax_for(scores.size, scores.dtype)
    probs = softmax(scores, visible[None, :, None])[0].reshape(kv_heads, 1, group * TILE, keys)
    sdpa_q, sdpa_k, sdpa_v = q.transpose(0, 2, 1, 3), k.transpose(1, 0, 2, 3), v.transpose(1, 0, 2, 3)
    additive = mx.where(visible, 0.0, -mx.inf)[:, None]
    mx.eval(q, k, v, visible, grouped_q, scores, probs, sdpa_q, sdpa_k, sdpa_v, additive)
    scale = head_dim ** -0.5
    ops = {
        "tinymlx attention": lambda: cpu.attention(q, k, v, visible, scale),
        "Q.K^T": lambda: grouped_q @ k.swapaxes(-1, -2),
        "masked softmax": lambda: softmax(scores, visible[None, :, None]),
        "MLX's masked softmax": lambda: unnormalized_softmax(scores, visible[None, :, None]),
        "P.V": lambda: probs @ v,
        "mx.fast SDPA": lambda: mx.fast.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v, scale=scale,
                                                                     mask=additive),
    }
    return {name: _ms(op, repeats) for name, op in ops.items()}


def _ms(op, repeats: int) -> float:
    mx.eval(op())
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(op())
    return 1000 * (time.perf_counter() - t0) / repeats


def _plot(contexts: list[int], ours: dict, peer: dict, ops: dict, n: int) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    x, width = np.arange(len(contexts)), 0.38
    ttft = [ours[c]["ttft_s"] for c in contexts]
    attention = [ours[c]["attention_s"] / ours[c]["timed_ttft_s"] * ours[c]["ttft_s"] for c in contexts]
    left.bar(x - width / 2, ttft, width, label="tinymlx", color="#2e75b6")
    left.bar(x - width / 2, attention, width, label="tinymlx: attention's share", color="#9dc3e6", hatch="//")
    left.bar(x + width / 2, [peer[c]["ttft_s"] for c in contexts], width, label="mlx-lm", color="#999999")
    left.set_xticks(x, [f"{c} cached" for c in contexts])
    left.set_ylabel("TTFT, s")
    left.set_title(f"{n} new tokens after a cached context")
    left.legend(fontsize=8)
    bottom = np.zeros(len(contexts))
    for name in ("Q.K^T", "masked softmax", "P.V"):
        values = np.array([ops[c][name] for c in contexts])
        right.bar(x - width / 2, values, width, bottom=bottom, label=f"tinymlx: {name}")
        bottom += values
    right.bar(x + width / 2, [ops[c]["mx.fast SDPA"] for c in contexts], width, label="mx.fast SDPA", color="#999999")
    right.plot(x - width / 2, [ops[c]["MLX's masked softmax"] for c in contexts], "k_", markersize=30,
               label="MLX's masked softmax (the GPU's path)")
    right.set_xticks(x, [f"{c} + {TILE} keys" for c in contexts])
    right.set_ylabel("ms, one layer, one query tile")
    right.set_title(f"attention op by op ({TILE} queries)")
    right.legend(fontsize=7)
    return fig


if __name__ == "__main__":
    main()
