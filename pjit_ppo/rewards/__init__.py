"""Reward functions behind the RewardFn interface: a reward model, or a fixed function of tokens.

A RewardFn maps (reward_params, query [B,Q], query_mask [B,Q], response [B,R],
response_mask [B,R]) to float32 scores [B]; the response is the truncated one.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

import jax.numpy as jnp

from pjit_ppo import padding
from pjit_ppo.models.config import ModelConfig
from pjit_ppo.models import scoring

#: (reward_params, query [B,Q], query_mask [B,Q], response [B,R], response_mask [B,R])
#: -> float32 scores [B]. Scores the truncated response.
RewardFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]



def model_reward_fn(reward_config: ModelConfig) -> RewardFn:
    """The reward model as a RewardFn: its score at the last real token of query+response."""
    def fn(reward_params, query, query_mask, response, response_mask):
        return scoring.sequence_reward(reward_config, reward_params, query, query_mask,
                                       response, response_mask)
    return fn


def target_token_reward(target_ids: Sequence[int]) -> RewardFn:
    """Score = fraction of the (truncated) response's real tokens that are in target_ids.

    Needs no trained reward model and its optimum is known (always emit target
    tokens), so learning is measurable: the CPU demo and the learning tests use it.
    float32 [B] in [0, 1]; reward_params are ignored (pass None).
    """
    targets = jnp.asarray(list(target_ids), jnp.int32)

    def fn(reward_params, query, query_mask, response, response_mask):
        del reward_params, query, query_mask
        hit = jnp.any(response[..., None] == targets, axis=-1) & response_mask
        n = jnp.maximum(jnp.sum(response_mask, axis=-1), 1)
        return jnp.sum(hit, axis=-1).astype(jnp.float32) / n

    return fn


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
