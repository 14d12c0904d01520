"""The reward rules every stage applies to sampled responses: truncate at the stop token,
score with the run's RewardFn, penalise a response that never stopped."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from pjit_ppo import padding

#: (reward_params, query [B,Q], query_mask [B,Q], response [B,R], response_mask [B,R])
#: -> float32 scores [B]. Scores the truncated response.
RewardFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def score_responses(cfg, reward_fn: RewardFn, reward_params, query, query_mask, response):
    """The reward rules of a rollout: truncate at the stop token, score, penalise no stop.

    Args:
      cfg: the PPOConfig (truncate_token, truncate_after, pad_token_id,
        penalty_reward_value).
      reward_fn, reward_params: the run's reward.
      query: int32 [B, Q] left-padded, query_mask bool [B, Q]; response: int32 [B, R]
        raw sampled tokens.
    Returns:
      (scores float32 [B] with the penalty applied, found bool [B] (a stop token was
      found), kept bool [B, R] (the positions the reward saw)).
    """
    if cfg.truncate_token is not None:
        truncated, found, kept = padding.truncate_after_stop(
            response, cfg.truncate_token, cfg.truncate_after, cfg.pad_token_id, with_mask=True)
    else:
        truncated, found = response, jnp.ones(response.shape[:1], bool)
        kept = jnp.ones(response.shape, bool)
    scores = reward_fn(reward_params, query, query_mask, jnp.where(kept, truncated, 0), kept)
    scores = padding.penalize_missing_stop(scores.astype(jnp.float32), found,
                                           cfg.penalty_reward_value)
    return scores, found, kept
