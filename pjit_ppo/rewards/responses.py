"""The reward rules every stage applies to sampled responses: truncate at the stop token,
score with the run's RewardFn, penalise a response that never stopped."""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from pjit_ppo import padding

#: (reward_params, query [B,Q], query_mask [B,Q], response [B,R], response_mask [B,R])
#: -> float32 scores [B]. Scores the truncated response. A reward with Python functions
#: (`pjit_ppo.rewards.host`) also takes host_scores=float32 [B, H].
RewardFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def truncate_responses(cfg, response: jax.Array):
    """The truncation the reward sees: (truncated int32 [B, R] (pad after the stop token),
    found bool [B] (a stop token at index >= truncate_after), kept bool [B, R] (the
    positions the reward sees: up to and including the stop token)). Without
    cfg.truncate_token every token is kept and every response counts as stopped."""
    if cfg.truncate_token is not None:
        return padding.truncate_after_stop(response, cfg.truncate_token, cfg.truncate_after,
                                           cfg.pad_token_id, with_mask=True)
    return response, jnp.ones(response.shape[:1], bool), jnp.ones(response.shape, bool)


def score_responses(cfg, reward_fn: RewardFn, reward_params, query, query_mask, response,
                    host_scores: Optional[jax.Array] = None):
    """The reward rules of a rollout: truncate at the stop token, score, penalise no stop.

    Args:
      cfg: the PPOConfig (truncate_token, truncate_after, pad_token_id,
        penalty_reward_value).
      reward_fn, reward_params: the run's reward.
      query: int32 [B, Q] left-padded, query_mask bool [B, Q]; response: int32 [B, R]
        raw sampled tokens.
      host_scores: float32 [B, H], the scores of the reward's Python functions
        (`pjit_ppo.rewards.host`), or None for a reward computed on the devices.
    Returns:
      (scores float32 [B] with the penalty applied, found bool [B] (a stop token was
      found), kept bool [B, R] (the positions the reward saw), terms float32 [B, T]:
      each term's own score for a reward of weighted terms (`reward_fn.names`), else
      None).
    """
    truncated, found, kept = truncate_responses(cfg, response)
    args = (reward_params, query, query_mask, jnp.where(kept, truncated, 0), kept)
    extra = {} if host_scores is None else {"host_scores": host_scores}
    terms = None
    if hasattr(reward_fn, "terms"):
        terms = reward_fn.terms(*args, **extra)
        scores = reward_fn.combine(terms)
    else:
        scores = reward_fn(*args, **extra)
    scores = padding.penalize_missing_stop(scores.astype(jnp.float32), found,
                                           cfg.penalty_reward_value)
    return scores, found, kept, terms
