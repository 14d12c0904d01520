"""Advantage estimators: from collected experience to advantages (and returns).

An estimator is chosen by `ppo.advantage_estimator`: a function that turns an
`Experience` into advantages (the second half of the rollout program) and the
loss the update differentiates (`pjit_ppo.ppo.losses`). The estimators are listed once,
in the jax-free table `pjit_ppo.config.estimators.ESTIMATORS` (the config validates
against it before jax starts); `ESTIMATORS` here holds the functions it names. Adding
an estimator: its function here (or in a new module) and one line in that table; the
trainer does not change.

  "gae"           PPO (Ziegler et al. 2019): per-token rewards -kl_coef * (logp -
                  ref_logp) with the score added at the last token, optionally whitened
                  (mean kept); GAE(gamma, lambda) with a terminal last step; advantages
                  whitened. Every response token counts. Loss: clipped policy loss +
                  vf_coef * clipped value loss.
  "grpo"          GRPO (Shao et al. 2024, DeepSeekMath): the score normalised within
                  its group of ppo.samples_per_prompt samples, (r - mean) / (std + eps),
                  on every token; the KL to the reference is not in the reward but a
                  k3 loss term weighted by ppo.kl_loss_coef. Dr. GRPO (Liu et al. 2025):
                  ppo.grpo_normalize_std=False with ppo.loss_aggregation="sequence_sum".
  "rloo"          RLOO (Ahmadian et al. 2024, "Back to Basics"): the whole response is
                  one action with reward score - kl_coef * sum(logp - ref_logp); its
                  advantage is that reward minus the mean reward of the group's other
                  samples (leave-one-out baseline).
  "reinforce_pp"  REINFORCE++ (Hu 2025): per-token rewards -kl_coef * (logp - ref_logp),
                  the score at the last counted token; discounted returns without a
                  critic, normalised over the global batch's tokens.

The critic-free estimators count the response tokens up to and including the stop
token (`Experience.mask`), in the KL, the rewards and the loss alike: the tokens
after it are never seen by the reward. The samples of a prompt are contiguous rows
(`group_size` of them); group statistics are plain jnp ops over the global array,
so they are right under jit whichever devices hold a group's rows.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from pjit_ppo import padding
from pjit_ppo.config import PPOConfig
from pjit_ppo.config.estimators import ESTIMATORS as ESTIMATOR_SPECS
from pjit_ppo.config.estimators import EstimatorSpec
from pjit_ppo.ppo.masked import masked_mean, masked_var
from pjit_ppo.ppo.types import Experience


def gae(rewards: jax.Array, values: jax.Array, gamma, lam) -> Tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over a fixed-length episode.

    The last time step is terminal: its next value is 0.

    Args:
      rewards: float [batch, time] per-token rewards.
      values: float [batch, time] value predictions V(s_t).
      gamma: discount, Python float or scalar array (may be traced).
      lam: GAE lambda, Python float or scalar array (may be traced).

    Returns:
      (advantages, returns), both float [batch, time] in the promoted dtype of
      ``rewards``/``values``; returns = advantages + values.
    """
    dtype = jnp.result_type(rewards, values)
    rewards = rewards.astype(dtype)
    values = values.astype(dtype)
    gamma = jnp.asarray(gamma, dtype)
    lam = jnp.asarray(lam, dtype)
    # Next-step values, with 0 after the terminal step.
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values

    def step(carry, delta_t):
        adv_t = delta_t + gamma * lam * carry
        return adv_t, adv_t

    _, adv_tb = jax.lax.scan(step, jnp.zeros(rewards.shape[:1], dtype), deltas.T, reverse=True)
    advantages = adv_tb.T
    return advantages, advantages + values


def whiten(
    x: jax.Array, shift_mean: bool = True, mask: Optional[jax.Array] = None, eps: float = 1e-8
) -> jax.Array:
    """Normalise ``x`` to unit variance (and zero mean if ``shift_mean``).

    Uses the population mean/variance over all elements of ``x`` (or over the
    elements where ``mask`` is nonzero): ``(x - mean) * rsqrt(var + eps)``; with
    ``shift_mean=False`` the mean is added back (the reference whitens rewards
    this way). Masked-out positions are transformed by the same formula; they do
    not affect the statistics.

    Args:
      x: float array of any shape, e.g. [batch, time].
      shift_mean: Python bool (static).
      mask: optional bool/float array broadcastable to ``x`` (1 = counts).
      eps: added to the variance.

    Returns:
      float array, same shape and dtype as ``x``.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    white = (x - mean) * jax.lax.rsqrt(var + jnp.asarray(eps, var.dtype))
    if not shift_mean:
        white = white + mean
    return white.astype(x.dtype)


def _groups(scores: jax.Array, group_size: int) -> jax.Array:
    """[B] -> [B // group_size, group_size]: the contiguous rows of each prompt."""
    if scores.ndim != 1 or scores.shape[0] % group_size:
        raise ValueError(f"scores of shape {scores.shape} cannot be split into groups of "
                         f"{group_size} contiguous rows")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group baseline needs >= 2 samples per "
                         f"prompt (ppo.samples_per_prompt)")
    return scores.reshape(-1, group_size)


def grpo_advantages(scores: jax.Array, group_size: int, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> jax.Array:
    """GRPO's outcome advantage: each score relative to its group.

    (r - group mean) / (group std + eps), with the sample standard deviation
    (ddof = 1, as TRL and veRL compute it); without ``normalize_std`` (Dr. GRPO)
    just r - group mean.

    Args:
      scores: float [B], B a multiple of group_size; group i is rows
        [i * group_size, (i + 1) * group_size).
      group_size: samples per prompt G >= 2 (Python int).
      normalize_std: divide by the group std (Python bool).
      eps: added to the std.

    Returns:
      float [B], the dtype of ``scores``.
    """
    groups = _groups(scores, group_size)
    adv = groups - jnp.mean(groups, axis=1, keepdims=True)
    if normalize_std:
        adv = adv / (jnp.std(groups, axis=1, ddof=1, keepdims=True) + eps)
    return adv.reshape(scores.shape).astype(scores.dtype)


def rloo_advantages(scores: jax.Array, group_size: int) -> jax.Array:
    """RLOO's advantage: each reward minus the mean of the other G - 1 rewards of its group.

    Args:
      scores: float [B], B a multiple of group_size, groups in contiguous rows.
      group_size: samples per prompt G >= 2 (Python int).

    Returns:
      float [B], the dtype of ``scores``.
    """
    groups = _groups(scores, group_size)
    others = (jnp.sum(groups, axis=1, keepdims=True) - groups) / (group_size - 1)
    return (groups - others).reshape(scores.shape).astype(scores.dtype)


def discounted_returns(rewards: jax.Array, gamma) -> jax.Array:
    """sum_{s >= t} gamma^(s - t) r_s per row: float [B, R] from float [B, R] rewards."""
    # GAE with zero values and lambda = 1 is exactly the discounted reward-to-go.
    returns, _ = gae(rewards, jnp.zeros_like(rewards), gamma, 1.0)
    return returns


def _reinforce_pp(rewards: jax.Array, mask: jax.Array, gamma) -> Tuple[jax.Array, jax.Array]:
    mask = mask.astype(bool)
    returns = discounted_returns(jnp.where(mask, rewards, 0), gamma)
    advantages = jnp.where(mask, whiten(returns, shift_mean=True, mask=mask), 0)
    return advantages, jnp.where(mask, returns, 0)


def reinforce_pp_advantages(rewards: jax.Array, mask: jax.Array, gamma) -> jax.Array:
    """REINFORCE++'s advantage: normalised discounted returns, no critic.

    The returns are the discounted reverse cumulative sums of the masked per-token
    rewards; they are normalised over every valid token of the whole batch,
    (x - mean) / sqrt(population var + 1e-8), and set to 0 where the mask is 0.

    Args:
      rewards: float [B, R] per-token rewards (KL penalty, the score at the last
        counted token); values where the mask is 0 are ignored.
      mask: bool/float [B, R], 1 = token counts.
      gamma: discount, Python float or scalar array.

    Returns:
      float [B, R].
    """
    return _reinforce_pp(rewards, mask, gamma)[0]


def kl_penalized_rewards(scores: jax.Array, logprobs: jax.Array, ref_logprobs: jax.Array,
                         kl_coef: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """Per-token rewards with the KL penalty, and the penalty alone.

    Args:
      scores: float32 [B], the score of each episode.
      logprobs, ref_logprobs: float32 [B, R], policy and reference at sampling time.
      kl_coef: float32 scalar.
    Returns:
      (rewards [B, R] = -kl_coef * (logp - ref_logp) with the score added at the last
      token, non_score_reward [B, R] = the penalty part).
    """
    non_score_reward = -kl_coef * (logprobs - ref_logprobs)
    return non_score_reward.at[:, -1].add(scores), non_score_reward


def gae_advantages(cfg: PPOConfig, exp: Experience, kl_coef: jax.Array
                   ) -> Tuple[jax.Array, jax.Array, Dict[str, jax.Array]]:
    """The reference estimator: KL-penalised rewards, GAE, whitened advantages.

    Returns (advantages [B, R], returns [B, R], float32 scalar metrics).
    """
    rewards, non_score_reward = kl_penalized_rewards(exp.scores, exp.logprobs,
                                                     exp.ref_logprobs, kl_coef)
    if cfg.whiten_rewards:
        rewards = whiten(rewards, shift_mean=False)
    advantages, returns = gae(rewards, exp.values, cfg.gamma, cfg.lam)
    advantages = whiten(advantages, shift_mean=True)
    values = exp.values
    non_score = jnp.sum(non_score_reward, axis=1)
    metrics = {
        "objective/non_score_reward": jnp.mean(non_score),
        "objective/score_total": jnp.mean(non_score + exp.scores),
        "ppo/returns/mean": jnp.mean(returns),
        "ppo/returns/var": jnp.var(returns),
        "ppo/val/mean": jnp.mean(values),
        "ppo/val/var": jnp.var(values),
        "ppo/val/advantage": jnp.mean(advantages),
    }
    return advantages, returns, metrics


def _group_metrics(name: str, rewards: jax.Array, scores: jax.Array, group_size: int
                   ) -> Dict[str, jax.Array]:
    """{name}/group_reward_std: mean over groups of the sample std of the rewards the
    advantages come from; {name}/zero_variance_group_frac: share of groups whose
    scores are all equal (no outcome signal to compare)."""
    groups = _groups(scores, group_size)
    return {
        f"{name}/group_reward_std": jnp.mean(jnp.std(_groups(rewards, group_size), axis=1,
                                                     ddof=1)),
        f"{name}/zero_variance_group_frac": jnp.mean(
            jnp.all(groups == groups[:, :1], axis=1).astype(jnp.float32)),
    }


def _per_token(advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """A per-sequence advantage [B] on every counted token: [B, R], 0 elsewhere."""
    return jnp.where(mask, advantages[:, None], jnp.zeros((), advantages.dtype))


def _sequence_kl(exp: Experience) -> jax.Array:
    """Per-episode sum of logp - ref_logp over the counted tokens: float32 [B]."""
    return jnp.sum(jnp.where(exp.mask, exp.logprobs - exp.ref_logprobs, 0), axis=1)


def grpo_estimator(cfg: PPOConfig, exp: Experience, kl_coef: jax.Array
                   ) -> Tuple[jax.Array, None, Dict[str, jax.Array]]:
    """GRPO: group-normalised scores on every counted token; the KL lives in the loss.

    Returns (advantages float32 [B, R], None, scalar metrics).
    """
    del kl_coef  # GRPO's KL is the loss term ppo.kl_loss_coef * k3
    g = cfg.samples_per_prompt
    adv = grpo_advantages(exp.scores, g, normalize_std=cfg.grpo_normalize_std)
    advantages = _per_token(adv, exp.mask)
    metrics = {**_group_metrics("grpo", exp.scores, exp.scores, g),
               "ppo/advantages/mean": masked_mean(advantages, exp.mask),
               "ppo/advantages/abs_mean": jnp.mean(jnp.abs(adv))}
    return advantages, None, metrics


def rloo_estimator(cfg: PPOConfig, exp: Experience, kl_coef: jax.Array
                   ) -> Tuple[jax.Array, None, Dict[str, jax.Array]]:
    """RLOO: sequence reward score - kl_coef * KL, leave-one-out baseline over the group.

    Returns (advantages float32 [B, R], None, scalar metrics).
    """
    g = cfg.samples_per_prompt
    non_score = -kl_coef * _sequence_kl(exp)
    rewards = exp.scores + non_score
    adv = rloo_advantages(rewards, g)
    advantages = _per_token(adv, exp.mask)
    metrics = {"objective/non_score_reward": jnp.mean(non_score),
               "objective/score_total": jnp.mean(rewards),
               **_group_metrics("rloo", rewards, exp.scores, g),
               "ppo/advantages/mean": masked_mean(advantages, exp.mask),
               "ppo/advantages/abs_mean": jnp.mean(jnp.abs(adv))}
    return advantages, None, metrics


def reinforce_pp_estimator(cfg: PPOConfig, exp: Experience, kl_coef: jax.Array
                           ) -> Tuple[jax.Array, None, Dict[str, jax.Array]]:
    """REINFORCE++: per-token KL-penalised rewards, the score at the last counted token,
    discounted returns normalised over the batch.

    Returns (advantages float32 [B, R], None, scalar metrics); the returns are not
    value targets (there is no critic), so only their statistics are reported.
    """
    mask = exp.mask
    non_score = jnp.where(mask, -kl_coef * (exp.logprobs - exp.ref_logprobs), 0)
    last = padding.last_true_index(mask, default=mask.shape[1] - 1)
    at_last = jax.nn.one_hot(last, mask.shape[1], dtype=non_score.dtype)
    rewards = non_score + at_last * exp.scores[:, None]
    advantages, returns = _reinforce_pp(rewards, mask, cfg.gamma)
    non_score_sum = jnp.sum(non_score, axis=1)
    metrics = {"objective/non_score_reward": jnp.mean(non_score_sum),
               "objective/score_total": jnp.mean(non_score_sum + exp.scores),
               "ppo/returns/mean": masked_mean(returns, mask),
               "ppo/returns/var": masked_var(returns, mask),
               "ppo/advantages/mean": masked_mean(advantages, mask)}
    return advantages, None, metrics


@dataclasses.dataclass(frozen=True)
class Estimator:
    """One advantage estimator: its spec (`pjit_ppo.config.estimators.EstimatorSpec`:
    uses_critic, min_samples_per_prompt, kl_in_reward, masks_after_stop, loss_uses_ref
    read through) and the functions the spec names.

    advantages: (cfg, Experience, kl_coef) -> (advantages [B, R], returns [B, R] or None,
      metrics).
    loss: (cfg, models, params, RolloutBatch micro-batch) -> (scalar loss, stats).
    """
    spec: EstimatorSpec
    advantages: Callable
    loss: Callable

    def __getattr__(self, name):  # the spec's facts, e.g. `estimator.uses_critic`
        if name == "spec":  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.spec, name)


def _function(path: str) -> Callable:
    """The function a spec names as "module:function"."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


#: ppo.advantage_estimator -> Estimator, in the order of the spec table (the one list
#: of estimators: pjit_ppo.config.estimators.ESTIMATORS; add an estimator there).
ESTIMATORS: Dict[str, Estimator] = {
    name: Estimator(spec, _function(spec.advantages), _function(spec.loss))
    for name, spec in ESTIMATOR_SPECS.items()}


def get(name: str) -> Estimator:
    """The estimator registered under `name` (ppo.advantage_estimator)."""
    if name not in ESTIMATORS:
        raise ValueError(f"ppo.advantage_estimator={name!r}; choose one of "
                         f"{', '.join(map(repr, ESTIMATORS))}")
    return ESTIMATORS[name]
