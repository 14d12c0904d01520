"""PPO losses: the clipped policy and value objectives, and the loss the update differentiates."""
from __future__ import annotations

from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from pjit_ppo.ppo import scoring
from pjit_ppo.ppo.masked import masked_mean, masked_var


def policy_loss(
    new_logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cliprange,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """Clipped-ratio PPO policy loss.

    Args:
      new_logprobs: float [batch, time] log pi_theta(a_t | s_t) of the sampled tokens.
      old_logprobs: float [batch, time] log-probs under the rollout policy.
      advantages: float [batch, time] (already whitened by the caller).
      mask: bool/float [batch, time], 1 = token counts.
      cliprange: float scalar, the ratio is clipped to [1 - c, 1 + c].

    Returns:
      (loss, stats): loss is a float scalar, the masked mean of
      max(-A * r, -A * clip(r)). stats are float scalars, all masked means:
      ``approxkl`` 0.5 * (new - old)^2, ``clipfrac`` fraction of tokens where the
      clipped term is the larger one, ``ratio`` and ``ratio_var`` (population
      variance) of r, ``loss`` (= loss).
    """
    logratio = new_logprobs - old_logprobs
    ratio = jnp.exp(logratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * jnp.clip(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(jnp.maximum(pg_losses, pg_losses2), mask)
    stats = {
        "loss": loss,
        "approxkl": 0.5 * masked_mean(jnp.square(logratio), mask),
        "clipfrac": masked_mean((pg_losses2 > pg_losses).astype(loss.dtype), mask),
        "ratio": masked_mean(ratio, mask),
        "ratio_var": masked_var(ratio, mask),
    }
    return loss, stats


def value_loss(
    new_values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    cliprange_value,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """Clipped value loss, 0.5 * masked mean of max((v - R)^2, (v_clip - R)^2).

    v_clip = old + clip(v - old, -c, c).

    Args:
      new_values: float [batch, time] current value predictions.
      old_values: float [batch, time] value predictions at rollout time.
      returns: float [batch, time] GAE returns.
      mask: bool/float [batch, time], 1 = token counts.
      cliprange_value: float scalar c.

    Returns:
      (loss, stats): float scalar loss; stats are float scalar masked means:
      ``clipfrac`` fraction where the clipped error is the larger one, ``error``
      (v - R)^2, ``vpred`` v, ``loss`` (= loss).
    """
    vpredclipped = old_values + jnp.clip(new_values - old_values, -cliprange_value, cliprange_value)
    vf_losses1 = jnp.square(new_values - returns)
    vf_losses2 = jnp.square(vpredclipped - returns)
    loss = 0.5 * masked_mean(jnp.maximum(vf_losses1, vf_losses2), mask)
    stats = {
        "loss": loss,
        "clipfrac": masked_mean((vf_losses2 > vf_losses1).astype(loss.dtype), mask),
        "error": masked_mean(vf_losses1, mask),
        "vpred": masked_mean(new_values, mask),
    }
    return loss, stats



def clipped_ppo_loss(cfg, models, params, mb) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """Clipped policy loss + vf_coef * clipped value loss on one micro-batch.

    Args:
      cfg: PPOConfig; models: PPOModels; params: the trainable tree;
      mb: a RolloutBatch micro-batch [b, ...].
    Returns:
      (loss, stats) with float32 scalar stats named as the metrics they become.
    """
    logprobs, values, entropy = scoring.policy_logprobs_and_values(
        cfg, models, params, mb.query, mb.query_mask, mb.response, with_entropy=True)
    mask = jnp.ones(mb.response.shape, jnp.float32)
    pg_loss, pg = policy_loss(logprobs, mb.logprobs, mb.advantages, mask, cfg.cliprange)
    vf_loss, vf = value_loss(values, mb.values, mb.returns, mask, cfg.cliprange_value)
    loss = pg_loss + cfg.vf_coef * vf_loss
    stats = {
        "ppo/policy/approxkl_avg": pg["approxkl"],
        "ppo/policy/clipfrac_avg": pg["clipfrac"],
        "ppo/policy/entropy_avg": jnp.mean(entropy),
        "ppo/loss/policy_avg": pg_loss,
        "ppo/loss/value_avg": vf_loss,
        "ppo/loss/total": loss,
        "ppo/val/clipfrac_avg": vf["clipfrac"],
        "ppo/val/error": vf["error"],
        "ppo/val/vpred": vf["vpred"],
        "ppo/val/ratio_avg": pg["ratio"],
    }
    return loss, stats
