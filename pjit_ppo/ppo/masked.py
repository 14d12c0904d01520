"""Masked reductions shared by the PPO math modules."""

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

Axis = Optional[Union[int, Sequence[int]]]


def masked_mean(x: jax.Array, mask: Optional[jax.Array] = None, axis: Axis = None) -> jax.Array:
    """Weighted mean of ``x`` over ``axis`` where ``mask`` is nonzero.

    Args:
      x: float array of any shape.
      mask: bool or float array broadcastable to ``x.shape`` (1 / True = counts),
        or None for a plain mean.
      axis: axes to reduce (None = all).

    Returns:
      float array of ``x.dtype`` with ``axis`` reduced. Where the mask selects no
      element the result is 0 (not NaN). Masked-out elements never contribute,
      even if they hold NaN/inf. Over a globally sharded array this is already
      the global mean; no explicit collective is needed.
    """
    if mask is None:
        return jnp.mean(x, axis=axis)
    m = jnp.broadcast_to(mask, x.shape).astype(x.dtype)
    # where() rather than x * m so that garbage (NaN/inf) in padded slots is dropped.
    num = jnp.sum(jnp.where(m != 0, x * m, jnp.zeros((), x.dtype)), axis=axis)
    den = jnp.sum(m, axis=axis)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), jnp.zeros((), x.dtype))


def masked_var(x: jax.Array, mask: Optional[jax.Array] = None, axis: Axis = None) -> jax.Array:
    """Population (biased, 1/N) variance of ``x`` over ``axis`` where ``mask`` is nonzero.

    Args/returns as :func:`masked_mean`.
    """
    mean = masked_mean(x, mask, axis=axis)
    if axis is not None:
        mean = jnp.expand_dims(mean, axis)
    return masked_mean(jnp.square(x - mean), mask, axis=axis)
