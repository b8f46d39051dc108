"""The gated delta rule (Gated DeltaNet's linear attention) and its short causal convolution, as
pure ``jnp`` functions over padded ``[batch, seq_len, ...]`` runs with an initial state.

The recurrence, per value head, with a state ``S`` of ``[k_head_dim, v_head_dim]``:

    S = S * exp(g_t)                         decay (g_t <= 0, in log space)
    S = S + k_t (beta_t (v_t - S^T k_t))^T   the delta rule: write the part S does not predict
    o_t = S^T q_t

with q and k L2-normed and q scaled by ``k_head_dim ** -0.5``. ``recurrent`` runs it token by
token (``lax.scan``: the reference, and a decode step's one token); ``chunked`` runs it a chunk
at a time (the WY/UT form transformers' ``torch_chunk_gated_delta_rule`` computes), for prefill.
Both match transformers' torch fallbacks. A padding token (``beta = 0``, ``g = 0``) leaves the
state unchanged in both, so a padded run's final state is its real tokens' state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_llm_runtime.models.layers.norms import row_mean

L2_EPS = 1e-6  # transformers' l2norm (the FLA library's)
CHUNK_SIZE = 64


def l2norm(x: jax.Array) -> jax.Array:  # [..., dim] float32
    """x / sqrt(sum(x^2) + eps), the sum in an order independent of the row count
    (``norms.row_mean``), so a sequence's numbers do not depend on its batch."""
    return x * jax.lax.rsqrt(row_mean(x * x) * x.shape[-1] + L2_EPS)


def normed_queries_keys(
    q: jax.Array,  # [batch, seq_len, num_k_heads, k_head_dim]
    k: jax.Array,  # [batch, seq_len, num_k_heads, k_head_dim]
    num_v_heads: int,
) -> tuple[jax.Array, jax.Array]:  # each [batch, seq_len, num_v_heads, k_head_dim] float32
    """q and k for the recurrence: each key head serves ``num_v_heads // num_k_heads``
    consecutive value heads; L2-normed in float32, q scaled by ``k_head_dim ** -0.5``."""
    group = num_v_heads // k.shape[-2]
    q, k = (jnp.repeat(x.astype(jnp.float32), group, axis=-2) for x in (q, k))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def recurrent(
    q: jax.Array,  # [batch, seq_len, heads, k_head_dim] float32, normed (normed_queries_keys)
    k: jax.Array,  # [batch, seq_len, heads, k_head_dim] float32, normed
    v: jax.Array,  # [batch, seq_len, heads, v_head_dim] float32
    g: jax.Array,  # [batch, seq_len, heads] float32, log decay
    beta: jax.Array,  # [batch, seq_len, heads] float32
    state: jax.Array,  # [batch, heads, k_head_dim, v_head_dim] float32
) -> tuple[jax.Array, jax.Array]:  # out [batch, seq_len, heads, v_head_dim], the final state
    """The recurrence token by token (``torch_recurrent_gated_delta_rule``)."""

    def one(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t = xs  # [batch, heads, ...]
        s = s * jnp.exp(g_t)[..., None, None]
        remembered = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - remembered) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    time_major = (jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(one, state, tuple(time_major))
    return jnp.moveaxis(out, 0, 1), state


def chunked(
    q: jax.Array,  # [batch, seq_len, heads, k_head_dim] float32, normed (normed_queries_keys)
    k: jax.Array,  # [batch, seq_len, heads, k_head_dim] float32, normed
    v: jax.Array,  # [batch, seq_len, heads, v_head_dim] float32
    g: jax.Array,  # [batch, seq_len, heads] float32, log decay
    beta: jax.Array,  # [batch, seq_len, heads] float32
    state: jax.Array,  # [batch, heads, k_head_dim, v_head_dim] float32
    chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:  # out [batch, seq_len, heads, v_head_dim], the final state
    """The recurrence a chunk at a time (``torch_chunk_gated_delta_rule``): within a chunk the
    delta-rule updates are condensed into one unit lower-triangular solve; the state passes
    between chunks. The run is padded to whole chunks with state-neutral tokens."""
    seq_len = q.shape[1]
    size = min(chunk_size, seq_len)
    pad = -seq_len % size
    # [batch, heads, chunks, size, ...]
    q, k, v = (_chunks(jnp.moveaxis(x, 1, 2), pad, size) for x in (q, k, v))
    g, beta = (_chunks(jnp.moveaxis(x, 1, 2)[..., None], pad, size)[..., 0] for x in (g, beta))
    cum = jnp.cumsum(g, axis=-1)  # [batch, heads, chunks, size]
    lower = jnp.tril(jnp.ones((size, size), bool))
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + strictly lower part of k_beta k^T * decay)^-1: the delta rule's updates in a chunk.
    system = _mm(k_beta, jnp.swapaxes(k, -1, -2)) * decay
    inverse = unit_lower_inverse(jnp.tril(system, -1))
    new_values = _mm(inverse, v_beta)
    k_cumdecay = _mm(inverse, k_beta * jnp.exp(cum)[..., None])
    intra = _mm(q, jnp.swapaxes(k, -1, -2)) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [batch, heads, chunks, 1, 1]

    def one(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        nv, kc, qd, kd, att, cd = xs
        v_new = nv - _mm(kc, s)
        out = _mm(qd, s) + _mm(att, v_new)
        return s * cd + _mm(jnp.swapaxes(kd, -1, -2), v_new), out

    xs = (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay)
    state, out = jax.lax.scan(one, state, tuple(jnp.moveaxis(x, 2, 0) for x in xs))
    out = jnp.moveaxis(out, 0, 2)  # [batch, heads, chunks, size, v_head_dim]
    out = out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :seq_len]
    return jnp.moveaxis(out, 1, 2), state


def unit_lower_inverse(
    strict: jax.Array,  # [..., n, n], strictly lower triangular
) -> jax.Array:  # [..., n, n]: (I + strict)^-1
    """The inverse of a unit lower-triangular matrix by repeated squaring: with M = -strict
    (nilpotent, M^n = 0), (I + strict)^-1 = (I + M)(I + M^2)(I + M^4)... — log2(n) batched
    matmuls. (XLA:CPU's batched triangular solve took longer than the rest of a chunked run.)"""
    n = strict.shape[-1]
    power = -strict
    inverse = jnp.eye(n, dtype=strict.dtype) + power
    for _ in range(max(0, (n - 1).bit_length() - 1)):
        power = _mm(power, power)
        inverse = inverse + _mm(inverse, power)
    return inverse


def _chunks(x: jax.Array, pad: int, size: int) -> jax.Array:
    """[batch, heads, seq_len, d] -> [batch, heads, chunks, size, d], zero-padded."""
    x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
    return x.reshape(*x.shape[:2], -1, size, x.shape[-1])


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def causal_conv(
    x: jax.Array,  # [batch, seq_len, channels]
    state: jax.Array,  # [batch, kernel - 1, channels]: the inputs before x, oldest first
    weight: jax.Array,  # [channels, kernel]
    lengths: jax.Array,  # [batch] int32: x's real tokens (the rest is padding)
) -> tuple[jax.Array, jax.Array]:  # silu(conv) [batch, seq_len, channels], the new state
    """The depthwise causal convolution over ``state`` then ``x``, with SiLU, and the state
    after each row's ``lengths`` tokens (its last ``kernel - 1`` inputs)."""
    kernel, seq_len = weight.shape[-1], x.shape[1]
    full = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [batch, kernel-1+seq_len, ch]
    w = weight.astype(jnp.float32)
    out = sum(full[:, i : i + seq_len].astype(jnp.float32) * w[:, i] for i in range(kernel))
    tail = lengths[:, None] + jnp.arange(kernel - 1)[None, :]  # [batch, kernel - 1]
    new_state = jnp.take_along_axis(full, tail[..., None], axis=1)
    return jax.nn.silu(out).astype(x.dtype), new_state
