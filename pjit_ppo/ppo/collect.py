"""Collection: sample responses, score them with every model, and apply the reward rules.

`collect` is the first half of the rollout program (the estimator is the second):
each prompt repeated `ppo.samples_per_prompt` times, sampling with the policy's KV
cache, the scoring passes (policy, reference, and the critic when the estimator has
one), truncation at the stop token, the reward, and the missing-stop penalty. It is
traceable and is compiled inside the trainer's rollout program.

A reward with Python functions (`pjit_ppo.rewards.host`) splits it in two traceable
halves with the host in between: `sample` (the sampling program: responses, their
log-probs and the positions the reward sees) and `score` (everything after, reading the
functions' scores as `host_scores`). Both run over the same micro-batches as `collect`
(`local_micro_batch_rows` says which of a process's rows each micro-batch holds, for the
host's one call per micro-batch), so each half computes what `collect` computes.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from pjit_ppo import sampling, sharding
from pjit_ppo.config import PPOConfig
from pjit_ppo.models import scoring
from pjit_ppo.ppo import estimators
from pjit_ppo.rewards.responses import score_responses, truncate_responses
from pjit_ppo.ppo.types import Experience, PPOModels, Sampled


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


def micro_batch_count(cfg: PPOConfig) -> int:
    """How many rollout micro-batches a batch is split into (1 = one pass)."""
    micro = cfg.rollout_micro_batch_size
    return 1 if micro in (0, cfg.batch_size) else cfg.batch_size // micro


def local_micro_batch_rows(cfg: PPOConfig, rows: np.ndarray, devices: int) -> np.ndarray:
    """Which micro-batch each of the batch rows `rows` (int [n], episode indices) is in:
    int [n] in [0, micro_batch_count). Micro-batch c holds the c-th slice of every batch
    device's rows (`to_micro_batches`)."""
    n = micro_batch_count(cfg)
    per_device = cfg.batch_size // devices
    return (np.asarray(rows) % per_device) // (per_device // n)


def _prepare(cfg: PPOConfig, query, query_mask, mesh):
    query_mask = query_mask.astype(bool)
    query = jnp.where(query_mask, query, 0)
    return repeat_prompts(cfg, query, query_mask, mesh)


def _over_micro_batches(cfg: PPOConfig, mesh, fn: Callable, query, query_mask, *extra):
    """fn(query [b, Q], query_mask, *extra rows, row_ids=, total_rows=, group=) over the
    batch's rows: in one pass, or (ppo.rollout_micro_batch_size) over micro-batches one
    after another (a `lax.map`) with the results joined back in the batch's order."""
    micro = cfg.rollout_micro_batch_size
    if micro in (0, cfg.batch_size):
        return fn(query, query_mask, *extra, group=cfg.samples_per_prompt)
    devices, n = batch_devices(mesh), cfg.batch_size // micro
    if micro % devices:
        raise ValueError(f"ppo.rollout_micro_batch_size={micro} cannot be split evenly over "
                         f"the mesh's {devices} batch devices (mesh.data x mesh.fsdp)")

    # A micro-batch holds whole groups (one prefill per prompt) when each device's
    # share of it does.
    group = cfg.samples_per_prompt if (micro // devices) % cfg.samples_per_prompt == 0 else 1

    def one(chunk):
        q, qm, rows, *rest = chunk
        if mesh is not None:
            q, qm = (sharding.constrain(x, mesh, ("batch", None)) for x in (q, qm))
            rest = [sharding.constrain(x, mesh, ("batch",) + (None,) * (x.ndim - 1))
                    for x in rest]
        return fn(q, qm, *rest, row_ids=rows, total_rows=cfg.batch_size, group=group)

    rows = jnp.arange(cfg.batch_size, dtype=jnp.int32)
    chunks = tuple(to_micro_batches(x, n, devices) for x in (query, query_mask, rows, *extra))
    stacked = jax.lax.map(one, chunks)

    def join(x):
        x = from_micro_batches(x, devices)
        if mesh is not None:
            x = sharding.constrain(x, mesh, ("batch",) + (None,) * (x.ndim - 1))
        return x
    return jax.tree.map(join, stacked)


def _metrics(models: PPOModels, experience: Experience, found, terms) -> Dict[str, jax.Array]:
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
    if terms is not None:  # a reward of weighted terms: each term's own mean
        for t, name in enumerate(models.reward_fn.names):
            metrics[f"reward/{name}"] = jnp.mean(terms[:, t])
    return metrics


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
      objective/stop_found_frac, and reward/<name> per term of a reward of weighted
      terms); with an estimator that masks after the stop token, the per-episode KL and
      entropy sum over the counted tokens only.
    """
    query, query_mask = _prepare(cfg, query, query_mask, mesh)

    def rows(q, qm, row_ids=None, total_rows=None, group=1):
        return _collect_rows(cfg, models, params, frozen, q, qm, key, mesh, row_ids=row_ids,
                             total_rows=total_rows, group=group)
    experience, found, terms = _over_micro_batches(cfg, mesh, rows, query, query_mask)
    return experience, _metrics(models, experience, found, terms)


def sample(cfg: PPOConfig, models: PPOModels, policy_params, query: jax.Array,
           query_mask: jax.Array, key: jax.Array, mesh=None) -> Sampled:
    """The sampling half of a split rollout (a reward with host functions): the responses
    `collect` would sample (same micro-batches, same random numbers), their log-probs,
    and the positions the reward sees (`truncate_responses`), all [B, R].

    policy_params: params["policy"]; query / query_mask / key as in `collect`.
    """
    query, query_mask = _prepare(cfg, query, query_mask, mesh)

    def rows(q, qm, row_ids=None, total_rows=None, group=1):
        return _sample_rows(cfg, models, policy_params, q, qm, key, mesh, row_ids=row_ids,
                            total_rows=total_rows, group=group)
    response, logprobs = _over_micro_batches(cfg, mesh, rows, query, query_mask)
    _, _, kept = truncate_responses(cfg, response)
    return Sampled(response, logprobs, kept)


def score(cfg: PPOConfig, models: PPOModels, params, frozen, query: jax.Array,
          query_mask: jax.Array, sampled: Sampled, host_scores: jax.Array, mesh=None
          ) -> Tuple[Experience, Dict[str, jax.Array]]:
    """The scoring half of a split rollout: what `collect` computes after sampling (the
    scoring passes, truncation, the reward, the penalty), over the same micro-batches,
    for the responses of `sample`.

    host_scores: float32 [B, H], the host functions' scores of each episode
    (`pjit_ppo.rewards.host_functions(models.reward_fn)` order). Returns as `collect`.
    """
    query, query_mask = _prepare(cfg, query, query_mask, mesh)

    def rows(q, qm, response, logprobs, host, row_ids=None, total_rows=None, group=1):
        del row_ids, total_rows, group
        return _score_rows(cfg, models, params, frozen, q, qm, response, logprobs, host)
    experience, found, terms = _over_micro_batches(
        cfg, mesh, rows, query, query_mask, sampled.response, sampled.logprobs, host_scores)
    return experience, _metrics(models, experience, found, terms)


def _collect_rows(cfg: PPOConfig, models: PPOModels, params, frozen, query: jax.Array,
                  query_mask: jax.Array, key: jax.Array, mesh=None, row_ids=None,
                  total_rows=None, group: int = 1):
    """Sampling and scoring of already repeated prompts [b, Q]: (Experience of b rows,
    bool [b] whether each response has a stop token, float32 [b, T] each reward term's
    score or None). row_ids / total_rows: see `sampling.generate` (a micro-batch of the
    whole batch); group: contiguous rows that share a prompt (`samples_per_prompt` of
    `sampling.generate`: one prefill per prompt)."""
    response, sample_logprobs = _sample_rows(cfg, models, params["policy"], query, query_mask,
                                             key, mesh, row_ids, total_rows, group)
    return _score_rows(cfg, models, params, frozen, query, query_mask, response,
                       sample_logprobs)


def _sample_rows(cfg: PPOConfig, models: PPOModels, policy_params, query, query_mask, key,
                 mesh=None, row_ids=None, total_rows=None, group: int = 1):
    """(response int32 [b, R], the sampler's log-probs float32 [b, R])."""
    opts = cfg.sampling_options()
    return sampling.generate(
        models.policy, policy_params, query, query_mask, key,
        max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
        top_p=opts.top_p, top_p_mode=opts.top_p_mode, mesh=mesh, row_ids=row_ids,
        total_rows=total_rows, samples_per_prompt=group)


def _score_rows(cfg: PPOConfig, models: PPOModels, params, frozen, query, query_mask,
                response, sample_logprobs, host_scores: Optional[jax.Array] = None):
    """The scoring passes and the reward of sampled rows: (Experience, found, terms)."""
    estimator = estimators.get(cfg.advantage_estimator)
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
    ref_logprobs = scoring.response_logprobs(models.reference, frozen["ref"], query,
                                             query_mask, response, cfg.temperature)

    # The reward model sees the truncated text; PPO trains on the raw one.
    scores, found, response_mask, terms = score_responses(
        cfg, models.reward_fn, frozen["reward"], query, query_mask, response, host_scores)

    mask = response_mask if estimator.masks_after_stop else None
    return (Experience(query, query_mask, response, logprobs, ref_logprobs, values, scores, mask),
            found, terms)
