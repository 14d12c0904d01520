"""LM head + log-probability of chosen tokens (+ entropy), with a hand-written backward.

Over a 50k vocabulary the [tokens, vocab] arrays dominate the cost of a PPO step
on CPU. Plain autodiff of `log_softmax(h @ W)[token]` makes several passes over
them: the exp again in the backward (softmax), the dense `onehot - softmax`
cotangent, and a transposed copy of it for the weight gradient. Here:

- the forward makes one exp pass and keeps the unnormalised `e = exp(logits - max)`;
- the backward never forms the [tokens, vocab] cotangent. With
  `g` the logprob cotangent and `w = g / sum(e)`, the cotangent of the logits is
  `g * onehot(token) - w * e`, so
      d hidden = g * W[token] - w * (e @ W)
      d W      = scatter_add(token, g * hidden) - (w * hidden)^T @ e
      d bias   = scatter_add(token, g) - w @ e
  i.e. two matmuls that read `e` once each, plus gathers and scatters of
  [tokens, d_model] rows;
- sums over the vocabulary are matrix-vector products, which XLA:CPU runs as dots
  at full speed, while its reduce fusions over 50k columns are slow.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp


def _contract_vocab(e, weight, vocab_major, dtype):
    """e [N, V] @ W -> float32 [N, D] (W is [V, D] if vocab_major else [D, V])."""
    dims = ((1,), (0,)) if vocab_major else ((1,), (1,))
    return jax.lax.dot_general(e.astype(dtype), weight.astype(dtype), (dims, ((), ())),
                               preferred_element_type=jnp.float32)


def _rows(weight, tokens, vocab_major):
    """W[token] as [N, D] float32."""
    rows = jnp.take(weight, tokens, axis=0) if vocab_major else jnp.take(weight, tokens, axis=1).T
    return rows.astype(jnp.float32)


def _logits(hidden, weight, bias, vocab_major, scale):
    """float32 (hidden @ W + bias) * scale: the scale is applied to float32 logits, so a
    bf16 compute dtype does not round 1 / temperature."""
    dims = ((1,), (1,)) if vocab_major else ((1,), (0,))
    logits = jax.lax.dot_general(hidden, weight.astype(hidden.dtype), (dims, ((), ())),
                                 preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    return logits if scale == 1.0 else logits * jnp.float32(scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_logprobs(hidden, weight, bias, tokens, vocab_major, scale):
    out, _ = _head_forward(hidden, weight, bias, tokens, vocab_major, scale)
    return out


def _head_forward(hidden, weight, bias, tokens, vocab_major, scale):
    logits = _logits(hidden, weight, bias, vocab_major, scale)
    top = jnp.max(logits, axis=-1)
    e = jnp.exp(logits - top[:, None])
    ones = jnp.ones(e.shape[-1], e.dtype)
    total = e @ ones
    logz = top + jnp.log(total)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    entropy = logz - ((e * logits) @ ones) / total
    residuals = (hidden, weight, bias, tokens, e, 1.0 / total)
    return (picked - logz, entropy), residuals


def _head_backward(vocab_major, scale, residuals, cotangents):
    hidden, weight, bias, tokens, e, inv_total = residuals
    g, _ = cotangents  # the entropy is a metric: no gradient through it
    # Every term below is linear in the cotangent of the scaled logits; the chain rule
    # through `* scale` multiplies them all by scale.
    g = g.astype(jnp.float32) * jnp.float32(scale)
    w = g * inv_total
    h32 = hidden.astype(jnp.float32)
    dtype = hidden.dtype  # the matmuls run in the compute dtype, accumulate in float32

    d_hidden = g[:, None] * _rows(weight, tokens, vocab_major) \
        - w[:, None] * _contract_vocab(e, weight, vocab_major, dtype)

    # (w * h)^T @ e as [D, V]: of the layouts XLA:CPU offers this contraction over
    # tokens runs fastest with the small operand first.
    dense = jax.lax.dot_general((w[:, None] * h32).astype(dtype), e.astype(dtype),
                                (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    picked_rows = g[:, None] * h32
    if vocab_major:
        d_weight = jnp.zeros(weight.shape, jnp.float32).at[tokens].add(picked_rows) - dense.T
    else:
        d_weight = jnp.zeros(weight.shape, jnp.float32).at[:, tokens].add(picked_rows.T) - dense
    d_bias = None
    if bias is not None:
        d_bias = (jnp.zeros(bias.shape, jnp.float32).at[tokens].add(g) - w @ e).astype(bias.dtype)
    return (d_hidden.astype(hidden.dtype), d_weight.astype(weight.dtype), d_bias, None)


_head_logprobs.defvjp(_head_forward, _head_backward)


def head_token_logprobs(hidden: jax.Array, weight: jax.Array, bias: Optional[jax.Array],
                        tokens: jax.Array, *, vocab_major: bool, scale: float = 1.0):
    """Log-softmax of the LM head's logits at the chosen tokens, and the entropy.

    Args:
      hidden: [..., D] hidden states (any float dtype; the matmuls run in it and
        accumulate in float32).
      weight: the head matrix, [V, D] if `vocab_major` (a tied embedding table)
        else [D, V], in its storage dtype (float32 master weights get a float32
        gradient); cast to hidden's dtype for the matmuls.
      bias: [V] or None.
      tokens: int [...] chosen token ids.
      vocab_major: the layout of `weight`.
      scale: static float multiplying the float32 logits (1 / temperature).

    Returns:
      (logprobs float32 [...], entropy float32 [...]). The entropy carries no
      gradient (it is a metric).
    """
    lead = tokens.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    logprobs, entropy = _head_logprobs(flat_hidden, weight, bias, tokens.reshape(-1),
                                       vocab_major, float(scale))
    return logprobs.reshape(lead), entropy.reshape(lead)
