"""Collection: sample responses, score them with every model, and apply the reward rules.

`collect` is the first half of the rollout program (the estimator is the second):
each prompt repeated `ppo.samples_per_prompt` times, sampling with the policy's KV
cache, the scoring passes (policy, reference, and the critic when the estimator has
one), truncation at the stop token, the reward, and the missing-stop penalty. It is
traceable and is compiled inside the trainer's rollout program.
"""
from __future__ import annotations

from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from pjit_ppo import sampling, sharding
from pjit_ppo.config import PPOConfig
from pjit_ppo.ppo import estimators, scoring
from pjit_ppo.ppo.rewards import score_responses
from pjit_ppo.ppo.types import Experience, PPOModels


def repeat_prompts(cfg: PPOConfig, query: jax.Array, query_mask: jax.Array, mesh=None
                   ) -> Tuple[jax.Array, jax.Array]:
    """Each prompt `ppo.samples_per_prompt` (G) times in contiguous rows: [P, Q] -> [P * G, Q].

    P must be `ppo.prompts_per_iteration` (batch_size // G). With a mesh the result
    stays split over the batch axes; a device holding whole prompts makes their
    groups locally.
    """
    g = cfg.samples_per_prompt
    if query.shape[0] != cfg.prompts_per_iteration:
        raise ValueError(
            f"got {query.shape[0]} prompts; ppo.batch_size={cfg.batch_size} episodes with "
            f"ppo.samples_per_prompt={g} need ppo.batch_size // ppo.samples_per_prompt = "
            f"{cfg.prompts_per_iteration} prompts per iteration")
    if g == 1:
        return query, query_mask
    query, query_mask = jnp.repeat(query, g, axis=0), jnp.repeat(query_mask, g, axis=0)
    if mesh is not None:
        batch_sh = sharding.batch_sharding(mesh, 2)
        query = jax.lax.with_sharding_constraint(query, batch_sh)
        query_mask = jax.lax.with_sharding_constraint(query_mask, batch_sh)
    return query, query_mask


def collect(cfg: PPOConfig, models: PPOModels, params, frozen, query: jax.Array,
            query_mask: jax.Array, key: jax.Array, mesh=None
            ) -> Tuple[Experience, Dict[str, jax.Array]]:
    """Samples `ppo.samples_per_prompt` responses per prompt and scores them.

    Args:
      params: the trainable tree ({"policy", "critic"}, {"policy", "value_head"}, or
        {"policy"} with a critic-free estimator).
      frozen: {"ref": reference policy params, "reward": reward params (any pytree)}.
      query: int32 [P, Q] left-padded prompts, P = ppo.batch_size // samples_per_prompt;
        query_mask bool [P, Q].
      key: PRNG key of this iteration's sampling.
      mesh: the device mesh (constrains the sampler's KV cache), or None.
    Returns:
      (Experience with B = ppo.batch_size rows, metrics): metrics are float32 scalars
      over the global batch (objective/kl, objective/entropy, objective/scores,
      objective/stop_found_frac); with an estimator that masks after the stop token,
      the per-episode KL and entropy sum over the counted tokens only.
    """
    estimator = estimators.get(cfg.advantage_estimator)
    query_mask = query_mask.astype(bool)
    query = jnp.where(query_mask, query, 0)
    query, query_mask = repeat_prompts(cfg, query, query_mask, mesh)
    opts = cfg.sampling_options()
    response, sample_logprobs = sampling.generate(
        models.policy, params["policy"], query, query_mask, key,
        max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
        top_p=opts.top_p, top_p_mode=opts.top_p_mode, mesh=mesh)

    if not estimator.uses_critic:
        values = None
        logprobs = (scoring.response_logprobs(models.policy, params["policy"], query,
                                              query_mask, response, cfg.temperature)
                    if cfg.recompute_rollout_logprobs else sample_logprobs)
    elif cfg.recompute_rollout_logprobs or cfg.shared_trunk:
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
    scores, found, response_mask = score_responses(cfg, models.reward_fn, frozen["reward"],
                                                   query, query_mask, response)

    mask = response_mask if estimator.masks_after_stop else None
    experience = Experience(query, query_mask, response, logprobs, ref_logprobs, values, scores,
                            mask)
    kl, neg_logprobs = logprobs - ref_logprobs, -logprobs
    if mask is not None:
        kl, neg_logprobs = jnp.where(mask, kl, 0), jnp.where(mask, neg_logprobs, 0)
    metrics = {
        "objective/kl": jnp.mean(jnp.sum(kl, axis=1)),
        "objective/entropy": jnp.mean(jnp.sum(neg_logprobs, axis=1)),
        "objective/scores": jnp.mean(scores),
        "objective/stop_found_frac": jnp.mean(found.astype(jnp.float32)),
    }
    return experience, metrics
