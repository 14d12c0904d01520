"""Generalised advantage estimation and whitening."""

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from pjit_ppo.ppo.masked import masked_mean, masked_var


def gae(rewards: jax.Array, values: jax.Array, gamma, lam) -> Tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over a fixed-length episode.

    The last time step is terminal: its next value is 0.

    Args:
      rewards: float [batch, time] per-token rewards.
      values: float [batch, time] value predictions V(s_t).
      gamma: discount, Python float or scalar array (may be traced).
      lam: GAE lambda, Python float or scalar array (may be traced).

    Returns:
      (advantages, returns), both float [batch, time] in the promoted dtype of
      ``rewards``/``values``; returns = advantages + values.
    """
    dtype = jnp.result_type(rewards, values)
    rewards = rewards.astype(dtype)
    values = values.astype(dtype)
    gamma = jnp.asarray(gamma, dtype)
    lam = jnp.asarray(lam, dtype)
    # Next-step values, with 0 after the terminal step.
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values

    def step(carry, delta_t):
        adv_t = delta_t + gamma * lam * carry
        return adv_t, adv_t

    _, adv_tb = jax.lax.scan(step, jnp.zeros(rewards.shape[:1], dtype), deltas.T, reverse=True)
    advantages = adv_tb.T
    return advantages, advantages + values


def whiten(
    x: jax.Array, shift_mean: bool = True, mask: Optional[jax.Array] = None, eps: float = 1e-8
) -> jax.Array:
    """Normalise ``x`` to unit variance (and zero mean if ``shift_mean``).

    Uses the population mean/variance over all elements of ``x`` (or over the
    elements where ``mask`` is nonzero): ``(x - mean) * rsqrt(var + eps)``; with
    ``shift_mean=False`` the mean is added back (the reference whitens rewards
    this way). Masked-out positions are transformed by the same formula; they do
    not affect the statistics.

    Args:
      x: float array of any shape, e.g. [batch, time].
      shift_mean: Python bool (static).
      mask: optional bool/float array broadcastable to ``x`` (1 = counts).
      eps: added to the variance.

    Returns:
      float array, same shape and dtype as ``x``.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    white = (x - mean) * jax.lax.rsqrt(var + jnp.asarray(eps, var.dtype))
    if not shift_mean:
        white = white + mean
    return white.astype(x.dtype)
