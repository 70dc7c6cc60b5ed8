"""The gated delta rule (Gated DeltaNet) and its short causal convolution, over padded batches of sequences.

Per value head, the state S [Dk, Dv] maps keys to values; each token t decays it, corrects what it
predicts for k_t towards v_t by beta_t, and reads it with q_t:

    S_t = exp(g_t) * S_{t-1} + beta_t * k_t (v_t - k_t^T exp(g_t) S_{t-1})^T        out_t = S_t^T q_t

Two forms compute the same thing. `recurrent` steps token by token (decodes: L = 1). `chunked` is the
chunk-wise (WY) form: inside a chunk of C tokens the corrections are solved at once as a triangular
system (a few [C, C] and [C, D] matmuls), and only the chunk-to-chunk state is carried sequentially.

Padding: a batch is B sequences padded to L tokens. Padded positions must carry g = 0 and beta = 0
(`mask_padding`): the state passes through them unchanged, and their outputs are dropped by the caller.
"""

from __future__ import annotations

import mlx.core as mx

from tinymlx.ops import kernels


def mask_padding(g: mx.array, beta: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """g and beta [B, L, H] zeroed past each sequence's length [B]: padding neither decays nor writes."""
    real = (mx.arange(g.shape[1])[None, :] < lengths[:, None])[..., None]
    return mx.where(real, g, 0.0), mx.where(real, beta, 0.0)


def recurrent(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
              keep: list[tuple[int, int]] = ()) -> tuple[mx.array, mx.array, list[mx.array]]:
    """q, k [B, L, H, Dk] (L2-normalised, q scaled), v [B, L, H, Dv], g (log decay) and beta [B, L, H],
    state [B, H, Dk, Dv] float32 -> (out [B, L, H, Dv], final state, and for each (row, t) of `keep` that
    row's state after its first t tokens [1, H, Dk, Dv]: any t, as `chunked` keeps only chunk ends)."""
    outputs, kept = [], {}
    for t in range(q.shape[1]):
        decay = kernels.exp(g[:, t])[..., None, None]  # [B, H, 1, 1]
        q_t, k_t = q[:, t, :, None, :], k[:, t, :, None, :]  # [B, H, 1, Dk]
        # One matmul reads the state for both the query and the key; the decay commutes with it.
        read = (mx.concatenate([q_t, k_t], axis=2) @ state) * decay  # [B, H, 2, Dv]
        delta = (v[:, t, :, None, :] - read[:, :, 1:]) * beta[:, t, :, None, None]  # [B, H, 1, Dv]
        state = state * decay + k_t.swapaxes(-1, -2) @ delta
        # q^T S_t = decay * q^T S_{t-1} + (q . k) delta, without reading the new state again.
        outputs.append(read[:, :, :1] + (q_t * k_t).sum(-1, keepdims=True) * delta)
        kept.update(((row, after), state[row:row + 1]) for row, after in keep if after == t + 1)
    return mx.concatenate(outputs, axis=2).swapaxes(1, 2), state, [kept[key] for key in keep]


def chunked(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
            chunk_size: int = 16, keep: list[tuple[int, int]] = ()) -> tuple[mx.array, mx.array, list[mx.array]]:
    """The same as `recurrent`, chunk-wise: for prefill, where L is long. Also returns, for each
    (row, t) of `keep`, that row's state after its first t tokens [1, H, Dk, Dv] (t a multiple of the chunk).

    On the CPU, chunks of 16 measured fastest: 5x the token-by-token form at L = 512 (16 heads of 128).
    """
    B, L, H, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk_size, L)
    pad = -L % C
    if pad:  # zero-padded tail: g = beta = 0 leaves the state as it is
        q, k, v = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        g, beta = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (g, beta))
    n = (L + pad) // C
    assert all(t % C == 0 and 0 < t <= n * C for _, t in keep), "a kept state must end a chunk"

    def chunks(x: mx.array) -> mx.array:  # [B, n*C, H, ...] -> [B, H, n, C, ...]
        x = x.reshape(B, n, C, H, *x.shape[3:])
        return x.transpose(0, 3, 1, 2, *range(4, x.ndim))

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = mx.cumsum(g, axis=-1)  # [B, H, n, C] log decay from the chunk's start
    lower = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    # decay[i, j] = exp(cum_i - cum_j) for j <= i: what token j's write has decayed by at token i.
    decay = mx.where(lower, kernels.exp(mx.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    k_beta = k * beta[..., None]
    # The WY form: the corrections of a chunk solve (I + A) u = beta v, A strictly lower triangular.
    A = mx.where(mx.tril(lower, -1), (k_beta @ k.swapaxes(-1, -2)) * decay, 0.0)
    T = _unit_lower_inverse(A)
    u = T @ (v * beta[..., None])  # [B, H, n, C, Dv] the corrections, before the carried state's part
    w = T @ (k_beta * kernels.exp(cum)[..., None])  # [B, H, n, C, Dk] how the carried state enters them
    intra = (q @ k.swapaxes(-1, -2)) * decay  # [B, H, n, C, C]
    q_decayed = q * kernels.exp(cum)[..., None]
    k_to_end = k * kernels.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = kernels.exp(cum[..., -1])[..., None, None]  # [B, H, n, 1, 1]

    outputs, kept = [], {}
    for i in range(n):  # the carried state, chunk by chunk
        v_new = u[:, :, i] - w[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].swapaxes(-1, -2) @ v_new
        kept.update(((row, t), state[row:row + 1]) for row, t in keep if t == (i + 1) * C)
    out = mx.stack(outputs, axis=2).reshape(B, H, n * C, Dv).swapaxes(1, 2)
    return out[:, :L], state, [kept[key] for key in keep]


def _unit_lower_inverse(A: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by doubling: A is nilpotent (A^C = 0), so
    (I + A)^-1 = (I - A)(I + A^2)(I + A^4)... : 2 log2(C) matmuls, with no triangular solve (which MLX
    runs only on the CPU)."""
    C = A.shape[-1]
    eye = mx.eye(C, dtype=A.dtype)
    power = -A
    inverse = eye + power
    span = 2
    while span < C:
        power = power @ power
        inverse = inverse @ (eye + power)
        span *= 2
    return inverse


def causal_conv(x: mx.array, state: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv1d over padded sequences, carrying the last K - 1 inputs between calls.

    x [B, L, C], state [B, K-1, C] (the inputs before x), weight [C, K] (HF's taps: the last one multiplies
    the current input) -> (out [B, L, C], the inputs [B, K-1+L, C]: state then x, whose slice [t : t+K-1]
    is the state after t tokens)."""
    K = weight.shape[-1]
    inputs = mx.concatenate([state.astype(x.dtype), x], axis=1)
    L = x.shape[1]
    return sum(inputs[:, j:j + L] * weight[:, j] for j in range(K)), inputs
