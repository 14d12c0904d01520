"""Reward functions behind the RewardFn interface: a reward model, or a fixed function of tokens.

A RewardFn maps (reward_params, query [B,Q], query_mask [B,Q], response [B,R],
response_mask [B,R]) to float32 scores [B]; the response is the truncated one.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp

from pjit_ppo.models.config import ModelConfig
from pjit_ppo.ppo import scoring
from pjit_ppo.ppo.types import RewardFn


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
