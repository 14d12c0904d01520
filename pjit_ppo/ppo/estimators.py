"""Advantage estimators: from collected experience to advantages and returns.

An estimator is a pair chosen by `ppo.advantage_estimator`: a function that turns
an `Experience` into advantages and returns (the second half of the rollout
program), and the loss the update differentiates (`pjit_ppo.ppo.losses`). Adding
an estimator means adding one `Estimator` entry to `ESTIMATORS`; the trainer does
not change.

  "gae"  per-token rewards -kl_coef * (logp - ref_logp) with the score added at the
         last token, optionally whitened (mean kept); GAE(gamma, lambda) with a
         terminal last step; advantages whitened. Loss: clipped PPO policy loss +
         vf_coef * clipped value loss.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from pjit_ppo.config import PPOConfig
from pjit_ppo.ppo import losses
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


@dataclasses.dataclass(frozen=True)
class Estimator:
    """One advantage estimator and the loss that goes with it.

    advantages: (cfg, Experience, kl_coef) -> (advantages [B, R], returns [B, R], metrics).
    loss: (cfg, models, params, RolloutBatch micro-batch) -> (scalar loss, stats).
    uses_critic: whether the run trains a critic (values in Experience and the loss).
    """
    advantages: Callable
    loss: Callable
    uses_critic: bool


ESTIMATORS: Dict[str, Estimator] = {
    "gae": Estimator(advantages=gae_advantages, loss=losses.clipped_ppo_loss, uses_critic=True),
}


def get(name: str) -> Estimator:
    """The estimator registered under `name` (ppo.advantage_estimator)."""
    if name not in ESTIMATORS:
        raise ValueError(f"ppo.advantage_estimator={name!r}; choose one of "
                         f"{', '.join(map(repr, ESTIMATORS))}")
    return ESTIMATORS[name]
