"""Collection: sample responses, score them with every model, and apply the reward rules.

`collect` is the first half of the rollout program (the estimator is the second):
sampling with the policy's KV cache, the scoring passes (policy, reference,
critic), truncation at the stop token, the reward, and the missing-stop penalty.
It is traceable and is compiled inside the trainer's rollout program.
"""
from __future__ import annotations

from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from pjit_ppo import padding, sampling
from pjit_ppo.config import PPOConfig
from pjit_ppo.ppo import scoring
from pjit_ppo.ppo.types import Experience, PPOModels


def collect(cfg: PPOConfig, models: PPOModels, params, frozen, query: jax.Array,
            query_mask: jax.Array, key: jax.Array, mesh=None
            ) -> Tuple[Experience, Dict[str, jax.Array]]:
    """Samples one response per prompt and scores it.

    Args:
      params: the trainable tree ({"policy", "critic"} or {"policy", "value_head"}).
      frozen: {"ref": reference policy params, "reward": reward params (any pytree)}.
      query: int32 [B, Q] left-padded prompts; query_mask bool [B, Q].
      key: PRNG key of this iteration's sampling.
      mesh: the device mesh (constrains the sampler's KV cache), or None.
    Returns:
      (Experience, metrics): metrics are float32 scalars over the global batch
      (objective/kl, objective/entropy, objective/scores,
      objective/stop_found_frac).
    """
    query_mask = query_mask.astype(bool)
    query = jnp.where(query_mask, query, 0)
    opts = cfg.sampling_options()
    response, sample_logprobs = sampling.generate(
        models.policy, params["policy"], query, query_mask, key,
        max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
        top_p=opts.top_p, top_p_mode=opts.top_p_mode, mesh=mesh)

    if cfg.recompute_rollout_logprobs or cfg.shared_trunk:
        logprobs, values = scoring.policy_logprobs_and_values(cfg, models, params, query,
                                                              query_mask, response)
        if not cfg.recompute_rollout_logprobs:
            logprobs = sample_logprobs
    else:  # the sampler's logprobs stand in for a second policy pass
        logprobs = sample_logprobs
        values = scoring.response_values(models.critic, params["critic"], query, query_mask,
                                         response)
    ref_logprobs = scoring.response_logprobs(models.policy, frozen["ref"], query, query_mask,
                                             response, cfg.temperature)

    # The reward model sees the truncated text; PPO trains on the raw one.
    if cfg.truncate_token is not None:
        truncated, found, response_mask = padding.truncate_after_stop(
            response, cfg.truncate_token, cfg.truncate_after, cfg.pad_token_id, with_mask=True)
    else:
        truncated, found = response, jnp.ones(response.shape[:1], bool)
        response_mask = jnp.ones(response.shape, bool)
    scores = models.reward_fn(frozen["reward"], query, query_mask,
                              jnp.where(response_mask, truncated, 0), response_mask)
    scores = padding.penalize_missing_stop(scores.astype(jnp.float32), found,
                                           cfg.penalty_reward_value)

    experience = Experience(query, query_mask, response, logprobs, ref_logprobs, values, scores)
    metrics = {
        "objective/kl": jnp.mean(jnp.sum(logprobs - ref_logprobs, axis=1)),
        "objective/entropy": jnp.mean(jnp.sum(-logprobs, axis=1)),
        "objective/scores": jnp.mean(scores),
        "objective/stop_found_frac": jnp.mean(found.astype(jnp.float32)),
    }
    return experience, metrics
