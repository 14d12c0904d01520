"""The rollout program: collection followed by the configured advantage estimator.

`rollout` is pure and the trainer jits it (with shardings), so the whole phase is
one compiled program: sampling, the scoring passes, rewards, and advantage
estimation, with nothing coming back to the host but the metrics.

A reward with Python functions (`pjit_ppo.rewards.host`) splits the phase: the trainer
compiles `collect.sample` (the sampling program), calls the functions on the host, and
compiles `score_rollout` (everything after sampling, the estimator included) with the
functions' scores as an input.
"""
from __future__ import annotations

from typing import Dict, Tuple

import jax

from pjit_ppo.config import PPOConfig
from pjit_ppo.ppo import estimators, lora_views
from pjit_ppo.ppo.collect import collect, score
from pjit_ppo.ppo.types import Experience, PPOModels, RolloutBatch, Sampled


def rollout(cfg: PPOConfig, models: PPOModels, params, frozen, kl_coef: jax.Array,
            query: jax.Array, query_mask: jax.Array, key: jax.Array, mesh=None
            ) -> Tuple[RolloutBatch, Dict[str, jax.Array]]:
    """One rollout over a batch of prompts.

    Args:
      params: {"policy": ..., "critic": ...} ({"policy", "value_head"} when shared,
        {"policy"} with a critic-free estimator); with LoRA, adapters on their frozen
        bases (`lora_views`).
      frozen: {"ref": reference policy params, "reward": reward params (any pytree)}.
      kl_coef: float32 scalar, current KL coefficient.
      query: int32 [P, Q] left-padded prompts, P = ppo.batch_size // samples_per_prompt;
        query_mask bool [P, Q].
      key: PRNG key of this iteration's sampling.
    Returns:
      (RolloutBatch of ppo.batch_size rows, dict of float32 scalar metrics).
    """
    params = lora_views.view(models, params, frozen)
    exp, metrics = collect(cfg, models, params, frozen, query, query_mask, key, mesh)
    return _estimate(cfg, exp, metrics, kl_coef)


def score_rollout(cfg: PPOConfig, models: PPOModels, params, frozen, kl_coef: jax.Array,
                  query: jax.Array, query_mask: jax.Array, sampled: Sampled,
                  host_scores: jax.Array, mesh=None
                  ) -> Tuple[RolloutBatch, Dict[str, jax.Array]]:
    """The second program of a split rollout: `rollout` after sampling.

    sampled: the sampling program's output (`collect.sample`) for these prompts;
    host_scores: float32 [B, H], the host functions' scores of each episode. Other
    arguments and the result as in `rollout`.
    """
    params = lora_views.view(models, params, frozen)
    exp, metrics = score(cfg, models, params, frozen, query, query_mask, sampled, host_scores,
                         mesh)
    return _estimate(cfg, exp, metrics, kl_coef)


def _estimate(cfg: PPOConfig, exp: Experience, metrics, kl_coef):
    estimator = estimators.get(cfg.advantage_estimator)
    advantages, returns, estimator_metrics = estimator.advantages(cfg, exp, kl_coef)
    batch = RolloutBatch(exp.query, exp.query_mask, exp.response, exp.logprobs, exp.values,
                         advantages, returns, mask=exp.mask,
                         ref_logprobs=exp.ref_logprobs if estimator.loss_uses_ref else None,
                         scores=exp.scores)
    metrics = {**metrics, **estimator_metrics}
    if estimator.kl_in_reward:
        metrics["objective/kl_coef"] = kl_coef
    return batch, metrics
