"""Collection: sample responses, score them with every model, and apply the reward rules.

`collect` is the first half of the rollout program (the estimator is the second):
each prompt repeated `ppo.samples_per_prompt` times, sampling with the policy's KV
cache, the scoring passes (policy, reference, and the critic when the estimator has
one), truncation at the stop token, the reward, and the missing-stop penalty. It is
traceable and is compiled inside the trainer's rollout program.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from pjit_ppo import sampling, sharding
from pjit_ppo.config import PPOConfig
from pjit_ppo.models import scoring
from pjit_ppo.ppo import estimators
from pjit_ppo.rewards import score_responses
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


def batch_devices(mesh) -> int:
    """How many devices the batch axis is split over (1 without a mesh)."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in sharding.DEFAULT_AXIS_RULES["batch"]
                     if a in mesh.shape)


def to_micro_batches(x: jax.Array, n: int, devices: int) -> jax.Array:
    """[B, ...] -> [n, B // n, ...]: micro-batch c holds the c-th slice of every device's
    rows, so splitting a batch-sharded array moves no data between devices."""
    b = x.shape[0]
    x = x.reshape((devices, n, b // (devices * n)) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape((n, b // n) + x.shape[3:])


def from_micro_batches(x: jax.Array, devices: int) -> jax.Array:
    """The inverse of `to_micro_batches`: [n, m, ...] -> [n * m, ...] in the batch's order."""
    n, m = x.shape[:2]
    x = x.reshape((n, devices, m // devices) + x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape((n * m,) + x.shape[3:])


def collect(cfg: PPOConfig, models: PPOModels, params, frozen, query: jax.Array,
            query_mask: jax.Array, key: jax.Array, mesh=None
            ) -> Tuple[Experience, Dict[str, jax.Array]]:
    """Samples `ppo.samples_per_prompt` responses per prompt and scores them.

    With `ppo.rollout_micro_batch_size` = m > 0 (and < batch_size), sampling and the
    scoring passes run over B / m micro-batches of m episodes one after another (a
    `lax.map`), so the KV cache and the activations are those of m episodes; every
    episode draws the random numbers it draws in the whole batch, so the samples are
    those of one pass (log-probs and values equal to float rounding: a matmul over
    fewer rows may round differently).

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
    query_mask = query_mask.astype(bool)
    query = jnp.where(query_mask, query, 0)
    query, query_mask = repeat_prompts(cfg, query, query_mask, mesh)
    micro = cfg.rollout_micro_batch_size
    if micro in (0, cfg.batch_size):
        experience, found = _collect_rows(cfg, models, params, frozen, query, query_mask, key,
                                          mesh, group=cfg.samples_per_prompt)
    else:
        devices, n = batch_devices(mesh), cfg.batch_size // micro
        if micro % devices:
            raise ValueError(f"ppo.rollout_micro_batch_size={micro} cannot be split evenly over "
                             f"the mesh's {devices} batch devices (mesh.data x mesh.fsdp)")

        # A micro-batch holds whole groups (one prefill per prompt) when each device's
        # share of it does.
        group = cfg.samples_per_prompt if (micro // devices) % cfg.samples_per_prompt == 0 else 1

        def one(chunk):
            q, qm, rows = chunk
            if mesh is not None:
                q, qm = (sharding.constrain(x, mesh, ("batch", None)) for x in (q, qm))
            return _collect_rows(cfg, models, params, frozen, q, qm, key, mesh,
                                 row_ids=rows, total_rows=cfg.batch_size, group=group)

        rows = jnp.arange(cfg.batch_size, dtype=jnp.int32)
        chunks = tuple(to_micro_batches(x, n, devices) for x in (query, query_mask, rows))
        stacked = jax.lax.map(one, chunks)

        def join(x):
            x = from_micro_batches(x, devices)
            if mesh is not None:
                x = sharding.constrain(x, mesh, ("batch",) + (None,) * (x.ndim - 1))
            return x
        experience, found = jax.tree.map(join, stacked)
    kl, neg_logprobs = experience.logprobs - experience.ref_logprobs, -experience.logprobs
    if experience.mask is not None:
        kl = jnp.where(experience.mask, kl, 0)
        neg_logprobs = jnp.where(experience.mask, neg_logprobs, 0)
    metrics = {
        "objective/kl": jnp.mean(jnp.sum(kl, axis=1)),
        "objective/entropy": jnp.mean(jnp.sum(neg_logprobs, axis=1)),
        "objective/scores": jnp.mean(experience.scores),
        "objective/stop_found_frac": jnp.mean(found.astype(jnp.float32)),
    }
    return experience, metrics


def _collect_rows(cfg: PPOConfig, models: PPOModels, params, frozen, query: jax.Array,
                  query_mask: jax.Array, key: jax.Array, mesh=None, row_ids=None,
                  total_rows=None, group: int = 1) -> Tuple[Experience, jax.Array]:
    """Sampling and scoring of already repeated prompts [b, Q]: (Experience of b rows,
    bool [b] whether each response has a stop token). row_ids / total_rows: see
    `sampling.generate` (a micro-batch of the whole batch); group: contiguous rows
    that share a prompt (`samples_per_prompt` of `sampling.generate`: one prefill
    per prompt)."""
    estimator = estimators.get(cfg.advantage_estimator)
    opts = cfg.sampling_options()
    response, sample_logprobs = sampling.generate(
        models.policy, params["policy"], query, query_mask, key,
        max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
        top_p=opts.top_p, top_p_mode=opts.top_p_mode, mesh=mesh, row_ids=row_ids,
        total_rows=total_rows, samples_per_prompt=group)

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
    return (Experience(query, query_mask, response, logprobs, ref_logprobs, values, scores, mask),
            found)
