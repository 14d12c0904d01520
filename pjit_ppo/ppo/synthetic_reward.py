"""A reward that is a fixed function of the tokens, behind the RewardFn interface.

Used by the CPU demo and the learning test: it needs no trained reward model, and
the optimum is known (always emit target tokens), so learning is measurable.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp

from pjit_ppo.ppo.rollout import RewardFn


def target_token_reward(target_ids: Sequence[int]) -> RewardFn:
    """Score = fraction of the (truncated) response's real tokens that are in target_ids.

    float32 [B] in [0, 1]; reward_params are ignored (pass None or {}).
    """
    targets = jnp.asarray(list(target_ids), jnp.int32)

    def fn(reward_params, query, query_mask, response, response_mask):
        del reward_params, query, query_mask
        hit = jnp.any(response[..., None] == targets, axis=-1) & response_mask
        n = jnp.maximum(jnp.sum(response_mask, axis=-1), 1)
        return jnp.sum(hit, axis=-1).astype(jnp.float32) / n

    return fn
