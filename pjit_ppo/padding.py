"""Jittable padding helpers, O(L) per row and free of sorts.

Moving real tokens to one end of a row is done by computing every token's
destination index from cumulative sums of the mask and moving all tokens with
a single scatter. (The reference JAX port used one argsort per row, which is
O(L log L) and lowers to a sort.)

All functions take int token arrays of shape [batch, length] and bool masks of
the same shape, and work eagerly and under ``jax.jit``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _pack(tokens: jax.Array, mask: jax.Array, pad_id: int, to_right: bool):
    """Moves mask-True tokens to one end of each row, keeping their order."""
    mask = mask.astype(bool)
    batch, length = tokens.shape
    mask_i = mask.astype(jnp.int32)
    n_real = mask_i.sum(axis=1, keepdims=True)  # [B, 1]
    real_rank = jnp.cumsum(mask_i, axis=1) - 1  # rank among real tokens
    pad_rank = jnp.cumsum(1 - mask_i, axis=1) - 1  # rank among pads
    if to_right:
        dest = jnp.where(mask, length - n_real + real_rank, pad_rank)
    else:
        dest = jnp.where(mask, real_rank, n_real + pad_rank)
    # dest is a permutation of 0..L-1 in every row, so the scatter has unique,
    # in-bounds indices.
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
    moved = jnp.zeros_like(tokens).at[rows, dest].set(
        tokens, unique_indices=True, mode="promise_in_bounds")
    positions = jnp.arange(length)[None, :]
    if to_right:
        new_mask = positions >= length - n_real
    else:
        new_mask = positions < n_real
    new_tokens = jnp.where(new_mask, moved, jnp.asarray(pad_id, tokens.dtype))
    return new_tokens, new_mask


def right_to_left_padding(tokens: jax.Array, mask: jax.Array, pad_id: int):
    """Converts right padding to left padding.

    Args:
      tokens: int [batch, length] token ids.
      mask: bool [batch, length], True at real tokens. Usually a prefix, but any
        pattern works: the True entries keep their relative order.
      pad_id: id written at every padded position of the result.

    Returns:
      (tokens, mask): tokens with tokens.dtype [batch, length], the real tokens
      flush against the right end and pad_id before them; bool [batch, length]
      mask of the new layout.
    """
    return _pack(tokens, mask, pad_id, to_right=True)


def left_to_right_padding(tokens: jax.Array, mask: jax.Array, pad_id: int):
    """Converts left padding to right padding.

    Args:
      tokens: int [batch, length] token ids.
      mask: bool [batch, length], True at real tokens (any pattern; the True
        entries keep their relative order).
      pad_id: id written at every padded position of the result.

    Returns:
      (tokens, mask): tokens with tokens.dtype [batch, length], the real tokens
      starting at index 0 and pad_id after them; bool [batch, length] mask of
      the new layout.
    """
    return _pack(tokens, mask, pad_id, to_right=False)


def first_true_index(mask: jax.Array, default=None) -> jax.Array:
    """Index of the first True in each row.

    Args:
      mask: bool [batch, length].
      default: value for rows with no True entry; None means ``length``.

    Returns:
      int32 [batch].
    """
    mask = mask.astype(bool)
    length = mask.shape[-1]
    if default is None:
        default = length
    # argmax of an all-False row is 0, so such rows are patched separately.
    idx = jnp.argmax(mask, axis=-1).astype(jnp.int32)
    return jnp.where(mask.any(axis=-1), idx, jnp.asarray(default, jnp.int32))


def last_true_index(mask: jax.Array, default: int = 0) -> jax.Array:
    """Index of the last True in each row.

    Args:
      mask: bool [batch, length].
      default: value for rows with no True entry.

    Returns:
      int32 [batch].
    """
    mask = mask.astype(bool)
    length = mask.shape[-1]
    idx = length - 1 - jnp.argmax(jnp.flip(mask, axis=-1), axis=-1).astype(jnp.int32)
    return jnp.where(mask.any(axis=-1), idx, jnp.asarray(default, jnp.int32))


def truncate_after_stop(tokens: jax.Array, stop_token: int, min_index,
                        pad_id: int, with_mask: bool = False):
    """Truncates each row after its first stop token at index >= min_index.

    This is the reference response truncation (truncate_token at index >=
    truncate_after): the stop token itself is kept, every later token becomes
    pad_id. Stop tokens before min_index are ignored.

    Args:
      tokens: int [batch, length].
      stop_token: the stop (truncate) token id.
      min_index: int, python or traced scalar; 0 considers the whole row,
        length (or more) never truncates.
      pad_id: id written after the stop token.
      with_mask: also return the mask of the kept positions.

    Returns:
      (tokens, found) or, with_mask, (tokens, found, kept): tokens with
      tokens.dtype [batch, length]; found bool [batch], True where a stop token
      occurs in positions min_index..length-1 (rows where it is False get the
      missing-stop penalty); kept bool [batch, length], True up to and including
      the stop token (everywhere in a row without one).
    """
    length = tokens.shape[-1]
    positions = jnp.arange(length)[None, :]
    hits = (tokens == stop_token) & (positions >= min_index)
    stop_at = first_true_index(hits, default=length)
    kept = positions <= stop_at[:, None]
    truncated = jnp.where(kept, tokens, jnp.asarray(pad_id, tokens.dtype))
    found = hits.any(axis=-1)
    return (truncated, found, kept) if with_mask else (truncated, found)


def penalize_missing_stop(scores: jax.Array, found: jax.Array,
                          penalty: float) -> jax.Array:
    """Replaces the score of rows without a stop token by ``penalty``.

    Args:
      scores: float [batch].
      found: bool [batch], from ``truncate_after_stop``.
      penalty: penalty_reward_value (reference default -1).

    Returns:
      scores.dtype [batch].
    """
    return jnp.where(found, scores, jnp.asarray(penalty, scores.dtype))


def position_ids_from_mask(mask: jax.Array) -> jax.Array:
    """Position ids as the exclusive cumulative sum of the attention mask.

    Real tokens are numbered 0, 1, 2, ... in order, so left padding does not
    shift positions. A pad position gets the number of real tokens before it:
    0 for left padding, the row's real-token count for trailing pads. Pads are
    masked out of attention, so their value only has to be a valid index.

    Args:
      mask: bool [batch, length], True at real tokens.

    Returns:
      int32 [batch, length].
    """
    mask_i = mask.astype(jnp.int32)
    return jnp.cumsum(mask_i, axis=-1) - mask_i
