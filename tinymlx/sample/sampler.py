"""Sampler: one token per row of a [B, V] logits batch, each row with its own SamplingParams.

Every stage is a [B, V] (or cheaper) op with per-row parameter arrays, and a stage runs only
when some row needs it. The order is vLLM's: penalties, structured-output masks, temperature, min-p, top-k, top-p, draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from tinymlx.core.outputs import TokenLogprobs
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.ops import kernels
from tinymlx.sample.structured import TokenMasks

# Top-k/top-p look only at the FILTER_HEAD best tokens: on CPU a full sort of a 152k vocab costs ~10x
# picking them. A wider nucleus is cut there (rare, near-flat rows); a larger top_k widens the head.
FILTER_HEAD = 4096
_BLOCK = 128


class SampleRequest(NamedTuple):
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Output tokens drawn but not yet read (a step run ahead: engine/run_ahead.py), after output_token_ids:
    # a seeded row's step counts them.
    num_pending_tokens: int = 0


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class DeviceSample(NamedTuple):
    """A step's draws, still on the device (or being computed): `resolve` brings them to the host.
    An overlapped step (engine/engine.py) feeds `token_ids` to the next forward before that."""

    token_ids: mx.array  # [B] int32
    logprobs: tuple[mx.array, ...]  # chosen, top ids, top logprobs of the rows in `want` (empty: none asked)
    want: list[int]  # rows that asked for logprobs
    nums: list[int]  # how many alternatives each of them asked for

    @property
    def arrays(self) -> list[mx.array]:
        return [self.token_ids, *self.logprobs]

    def resolve(self) -> SamplerOutput:
        """The draws on the host: the step's one host sync."""
        mx.eval(self.arrays)
        token_ids = self.token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if self.want:
            chosen, top_ids, top_lps = (a.tolist() for a in self.logprobs)
            for j, (i, n) in enumerate(zip(self.want, self.nums)):
                logprobs[i] = TokenLogprobs(token_ids[i], chosen[j], list(zip(top_ids[j][:n], top_lps[j][:n])))
        return SamplerOutput(token_ids, logprobs)


class Sampler:
    def __call__(self, logits: mx.array, rows: Sequence[SampleRequest], masks: TokenMasks | None = None) -> SamplerOutput:
        """`masks`: the allowed tokens of the constrained rows; the other rows pay nothing for them."""
        return self.sample(logits, rows, masks).resolve()

    def sample(self, logits: mx.array, rows: Sequence[SampleRequest], masks: TokenMasks | None = None) -> DeviceSample:
        """The draws as MLX arrays, not yet evaluated: what `__call__` reads back."""
        B, V = logits.shape
        if len(rows) != B:
            raise ValueError(f"got {len(rows)} sample requests for {B} rows of logits")
        if B == 0:
            return DeviceSample(mx.zeros((0,), dtype=mx.int32), (), [], [])
        raw = logits.astype(mx.float32)
        x = apply_penalties(raw, rows)
        if masks is not None and masks.rows:
            x = apply_token_masks(x, masks)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        parts = []
        if greedy:
            parts.append(mx.argmax(_take_rows(x, greedy), axis=-1))
        if sampled:
            parts.append(_sample(_take_rows(x, sampled), [rows[i] for i in sampled]))
        tokens = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        if greedy and sampled:  # back to row order
            tokens = tokens[mx.array(np.argsort(greedy + sampled))]
        tokens = tokens.astype(mx.int32)

        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        nums = [rows[i].params.logprobs for i in want]
        lp = _logprobs(_take_rows(raw, want), _take_rows(tokens, want), nums) if want else ()
        return DeviceSample(tokens, lp, want, nums)


def apply_penalties(logits: mx.array, rows: Sequence[SampleRequest]) -> mx.array:
    """Repetition (HF: prompt + output), presence and frequency (OpenAI: output only) penalties.

    Only the (row, token) pairs seen so far change, so this gathers and scatters those few
    logits instead of sweeping the whole [B, V] batch.
    """
    B, V = logits.shape
    flat_ids, counts, penalised = [], [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            continue
        ids, cnt = np.unique(np.asarray(r.output_token_ids, dtype=np.int64), return_counts=True)
        if p.repetition_penalty != 1.0 and len(r.prompt_token_ids):
            prompt_only = np.setdiff1d(np.asarray(r.prompt_token_ids, dtype=np.int64), ids)
            ids = np.concatenate([ids, prompt_only])
            cnt = np.concatenate([cnt, np.zeros(len(prompt_only), dtype=cnt.dtype)])
        ids, cnt = ids[ids < V], cnt[ids < V]  # an id past the vocab would land in the next row
        flat_ids.append(i * V + ids)
        counts.append(cnt)
        penalised.append(p)
    num_pairs = [len(ids) for ids in flat_ids]
    if not sum(num_pairs):
        return logits

    def per_pair(values: list[float]) -> mx.array:
        return mx.array(np.repeat(np.asarray(values, dtype=np.float32), num_pairs))

    rep = per_pair([p.repetition_penalty for p in penalised])
    pres = per_pair([p.presence_penalty for p in penalised])
    freq = per_pair([p.frequency_penalty for p in penalised])
    idx = mx.array(np.concatenate(flat_ids))
    count = mx.array(np.concatenate(counts).astype(np.float32))
    flat = logits.reshape(-1)
    seen = flat[idx]
    seen = mx.where(seen > 0, seen / rep, seen * rep)
    seen = seen - freq * count - pres * (count > 0)
    flat[idx] = seen  # ids are unique per row, so this is a plain scatter
    return flat.reshape(B, V)


def apply_token_masks(logits: mx.array, masks: TokenMasks) -> mx.array:
    """-inf where a constrained row's bitmask has a 0 bit; only the masked rows are touched."""
    B, V = logits.shape
    # Unpacked on the host: numpy's unpackbits is ~10x faster than shifting [n, V/32, 32] words in MLX.
    allowed = mx.array(np.unpackbits(masks.bitmask.view(np.uint8), axis=1, bitorder="little")[:, :V].view(np.bool_))
    if len(masks.rows) == B:
        return mx.where(allowed, logits, -mx.inf)
    rows = mx.array(masks.rows, dtype=mx.int32)
    out = logits.reshape(B, V)  # a new array: assigning into it leaves `logits` (logprobs read it) as it was
    out[rows] = mx.where(allowed, logits[rows], -mx.inf)
    return out


def _sample(x: mx.array, rows: list[SampleRequest]) -> mx.array:
    """Scale by temperature, drop what the filters reject, draw from what is left."""
    temperature = mx.array([r.params.temperature for r in rows])[:, None]
    s = x / temperature
    top = s.max(axis=-1, keepdims=True)
    e = kernels.exp(s - top)  # unnormalised probabilities, 1.0 at the best token
    threshold = _threshold(s, top, e, [r.params for r in rows])
    if threshold is not None:
        e = mx.where(s >= threshold, e, 0.0)
    return draw(e, _uniforms(rows))


def draw(e: mx.array, u: mx.array) -> mx.array:
    """Inverse-CDF draw from unnormalised probabilities e [n, V] with uniforms u [n, 2]: first a
    block of _BLOCK tokens by block mass, then a token within it. One float32 CDF over 152k tokens
    can't resolve tokens below ~1e-7 of the total; per-block CDFs can, and skip a [n, V] cumsum."""
    n, V = e.shape
    if V % _BLOCK:
        e = mx.concatenate([e, mx.zeros((n, _BLOCK - V % _BLOCK), e.dtype)], axis=1)
    blocks = e.reshape(n, -1, _BLOCK)
    block = _search(mx.cumsum(blocks.sum(axis=-1), axis=-1), u[:, 0])
    local = mx.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    return block * _BLOCK + _search(mx.cumsum(local, axis=-1), u[:, 1])


def _search(cdf: mx.array, u: mx.array) -> mx.array:
    # u * total < total, so the count stops at an entry with nonzero mass: zero-mass entries are never picked.
    return (cdf <= u[:, None] * cdf[:, -1:]).sum(axis=-1)


def _threshold(s: mx.array, top: mx.array, e: mx.array, params: list[SamplingParams]) -> mx.array | None:
    """Per-row value a token must reach to survive min-p, top-k and top-p; None if no row filters."""
    n, V = s.shape
    top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    has_min_p = any(p.min_p > 0 for p in params)
    has_top_p = any(p.top_p < 1 for p in params)
    if not (has_min_p or has_top_p or any(top_k)):
        return None
    # min-p keeps p >= min_p * p_max, i.e. s >= s_max + log(min_p); log(0) = -inf keeps all.
    with np.errstate(divide="ignore"):
        threshold = top + mx.array(np.log([p.min_p for p in params], dtype=np.float32))[:, None]
    if not (has_top_p or any(top_k)):
        return threshold
    head = mx.sort(mx.topk(s, min(V, max(FILTER_HEAD, *top_k)), axis=-1), axis=-1)[:, ::-1]  # best first
    if any(top_k):
        k = mx.array(top_k)[:, None]
        kth = mx.take_along_axis(head, mx.maximum(k - 1, 0), axis=-1)
        threshold = mx.where(k > 0, mx.maximum(threshold, kth), threshold)
    if has_top_p:
        # Keep a token while the mass ranked above it is < top_p of what min-p/top-k left.
        total = mx.where(s >= threshold, e, 0.0).sum(axis=-1, keepdims=True)
        head_e = mx.where(head >= threshold, kernels.exp(head - top), 0.0)
        above = mx.cumsum(head_e, axis=-1) - head_e
        top_p = mx.array([p.top_p for p in params])[:, None]
        num_kept = mx.minimum((above < top_p * total).sum(axis=-1, keepdims=True), FILTER_HEAD)
        last = mx.take_along_axis(head, num_kept - 1, axis=-1)
        threshold = mx.where(top_p < 1, mx.maximum(threshold, last), threshold)
    return threshold


def _uniforms(rows: list[SampleRequest]) -> mx.array:
    """U[0, 1) [n, 2]. A seeded row's draws depend only on (seed, tokens generated so far), never
    on its batch neighbours; unseeded rows share one draw from MLX's global generator."""
    u = mx.random.uniform(shape=(len(rows), 2))
    seeds = [r.params.seed for r in rows]
    if all(seed is None for seed in seeds):
        return u
    host = np.zeros((len(rows), 2), dtype=np.float32)
    for i, (seed, r) in enumerate(zip(seeds, rows)):
        if seed is not None:
            # SeedSequence hashes (seed, step) into an independent stream: no state carried between steps.
            step = len(r.output_token_ids) + r.num_pending_tokens
            host[i] = np.random.default_rng([seed, step]).random(2, dtype=np.float32)
    return mx.where(mx.array([[seed is not None] for seed in seeds]), mx.array(host), u)


def _logprobs(raw: mx.array, tokens: mx.array, nums: list[int]) -> tuple[mx.array, mx.array, mx.array]:
    """Log-softmax of the raw logits (as vLLM): the chosen token's, and the best max(nums) sorted."""
    top = raw.max(axis=-1, keepdims=True)
    lse = top + mx.log(kernels.exp(raw - top).sum(axis=-1, keepdims=True))
    chosen = mx.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - lse[:, 0]
    n = min(max(nums), raw.shape[-1])
    if n == 0:
        empty = mx.zeros((len(nums), 0))
        return chosen, empty.astype(mx.int32), empty
    ids = mx.argpartition(-raw, kth=n - 1, axis=-1)[:, :n]
    vals = mx.take_along_axis(raw, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1)
    return chosen, ids, mx.take_along_axis(vals, order, axis=-1) - lse


def _take_rows(x: mx.array, rows: list[int]) -> mx.array:
    return x if len(rows) == x.shape[0] else x[mx.array(rows, dtype=mx.int32)]

