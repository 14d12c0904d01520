"""Rollout: sample, score, and turn scores into advantages, as one traceable function.

`rollout` is pure and is jitted (with shardings) by the trainer, so the whole
phase is one compiled program: sampling, post-processing, four model passes,
rewards, GAE and whitening, with nothing coming back to the host but metrics.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from pjit_ppo import padding, sampling
from pjit_ppo.models import heads
from pjit_ppo.models.config import ModelConfig
from pjit_ppo.ppo import scoring
from pjit_ppo.ppo.advantages import gae, whiten
from pjit_ppo.ppo.config import PPOConfig
from pjit_ppo.ppo.masked import masked_var

# (reward_params, query [B,Q], query_mask [B,Q], response [B,R], response_mask [B,R]) -> [B]
RewardFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class PPOModels:
    """Static description of the models of a run (hashable, closed over by jit).

    policy: the policy's (and reference's) architecture.
    critic: the separate critic's architecture; None with a shared trunk.
    reward_fn: scores (query, truncated response); `model_reward_fn(reward_config)`
      gives the reward-model one; tests and demos may pass any function of tokens.
    """
    policy: ModelConfig
    critic: Optional[ModelConfig]
    reward_fn: RewardFn


def model_reward_fn(reward_config: ModelConfig) -> RewardFn:
    """The reward model as a RewardFn: score at the last real token of query+response."""
    def fn(reward_params, query, query_mask, response, response_mask):
        return scoring.sequence_reward(reward_config, reward_params, query, query_mask,
                                       response, response_mask)
    return fn


class RolloutBatch(NamedTuple):
    """What the update trains on; every field is [B, ...], sharded over the batch."""
    query: jax.Array        # int32 [B, Q], left-padded
    query_mask: jax.Array   # bool [B, Q]
    response: jax.Array     # int32 [B, R], raw sampled tokens (PPO trains on these)
    logprobs: jax.Array     # float32 [B, R], policy at sampling time
    values: jax.Array       # float32 [B, R], critic at sampling time
    advantages: jax.Array   # float32 [B, R], whitened
    returns: jax.Array      # float32 [B, R]


def policy_logprobs_and_values(cfg: PPOConfig, models: PPOModels, params, query, query_mask,
                               response, with_entropy=False):
    """Policy logprobs (temperature-scaled) and critic values for a batch: [B, R] each.

    With `with_entropy`, also the per-token entropy [B, R] of the policy.
    """
    hidden = scoring.response_hidden(models.policy, params["policy"], query, query_mask, response)
    out = scoring.logprobs_from_hidden(models.policy, params["policy"], hidden, response,
                                       cfg.temperature, with_entropy)
    if cfg.shared_trunk:
        values = heads.value_from_hidden(params, hidden)
    else:
        values = scoring.response_values(models.critic, params["critic"], query, query_mask,
                                         response)
    if with_entropy:
        return out[0], values, out[1]
    return out, values


def rollout(cfg: PPOConfig, models: PPOModels, params, frozen, kl_coef: jax.Array,
            query: jax.Array, query_mask: jax.Array, key: jax.Array, mesh=None):
    """One rollout over a batch of prompts.

    Args:
      params: {"policy": ..., "critic": ...} (or {"policy", "value_head"} when shared).
      frozen: {"ref": reference policy params, "reward": reward params (any pytree)}.
      kl_coef: float32 scalar, current KL coefficient.
      query: int32 [B, Q] left-padded prompts; query_mask bool [B, Q].
      key: PRNG key of this iteration (fresh per iteration).
    Returns:
      (RolloutBatch, dict of float32 scalar metrics named as in REFERENCE.md).
    """
    query_mask = query_mask.astype(bool)
    query = jnp.where(query_mask, query, 0)
    response, sample_logprobs = sampling.generate(
        models.policy, params["policy"], query, query_mask, key,
        max_new_tokens=cfg.response_length, temperature=cfg.temperature, top_k=cfg.top_k,
        top_p=cfg.top_p, mesh=mesh)

    if cfg.recompute_rollout_logprobs or cfg.shared_trunk:
        logprobs, values = policy_logprobs_and_values(cfg, models, params, query, query_mask,
                                                      response)
        if not cfg.recompute_rollout_logprobs:
            logprobs = sample_logprobs
    else:  # the sampler's logprobs stand in for a second policy pass
        logprobs = sample_logprobs
        values = scoring.response_values(models.critic, params["critic"], query, query_mask,
                                         response)
    ref_logprobs = scoring.response_logprobs(models.policy, frozen["ref"], query, query_mask,
                                             response, cfg.temperature)

    # Post-process: the reward model sees the truncated text; PPO trains on the raw one.
    r = cfg.response_length
    if cfg.truncate_token is not None:
        truncated, found = padding.truncate_after_stop(response, cfg.truncate_token,
                                                       cfg.truncate_after, cfg.pad_token_id)
        positions = jnp.arange(r)[None, :]
        stop_at = padding.first_true_index(
            (response == cfg.truncate_token) & (positions >= cfg.truncate_after), default=r)
        response_mask = positions <= stop_at[:, None]
    else:
        truncated, found = response, jnp.ones(response.shape[:1], bool)
        response_mask = jnp.ones(response.shape, bool)
    scores = models.reward_fn(frozen["reward"], query, query_mask,
                              jnp.where(response_mask, truncated, 0), response_mask)
    scores = padding.penalize_missing_stop(scores.astype(jnp.float32), found,
                                           cfg.penalty_reward_value)

    kl = logprobs - ref_logprobs
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.at[:, -1].add(scores)
    if cfg.whiten_rewards:
        rewards = whiten(rewards, shift_mean=False)
    advantages, returns = gae(rewards, values, cfg.gamma, cfg.lam)
    advantages = whiten(advantages, shift_mean=True)

    batch = RolloutBatch(query, query_mask, response, logprobs, values, advantages, returns)
    metrics = {
        "objective/kl": jnp.mean(jnp.sum(kl, axis=1)),
        "objective/entropy": jnp.mean(jnp.sum(-logprobs, axis=1)),
        "objective/non_score_reward": jnp.mean(jnp.sum(non_score_reward, axis=1)),
        "objective/scores": jnp.mean(scores),
        "objective/score_total": jnp.mean(jnp.sum(non_score_reward, axis=1) + scores),
        "objective/kl_coef": kl_coef,
        "objective/stop_found_frac": jnp.mean(found.astype(jnp.float32)),
        "ppo/returns/mean": jnp.mean(returns),
        "ppo/returns/var": jnp.var(returns),
        "ppo/val/mean": jnp.mean(values),
        "ppo/val/var": jnp.var(values),
        "ppo/val/advantage": jnp.mean(advantages),
        "ppo/val/var_explained": 1.0 - masked_var(returns - values) / masked_var(returns),
    }
    return batch, metrics
