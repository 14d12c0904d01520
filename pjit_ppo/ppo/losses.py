"""Policy-gradient losses: the clipped policy and value objectives, their options, and the
losses the update differentiates (one per estimator family).

Policy-loss options (PPOConfig fields, the same loss for every estimator):
  - `loss_aggregation`: how per-token terms become one number (`aggregate`).
  - `cliprange_low` / `cliprange_high`: decoupled clipping, the ratio clipped to
    [1 - low, 1 + high] ("clip-higher", DAPO: Yu et al. 2025).
  - `importance_ratio="sequence"`: GSPO's sequence-level ratio (Zheng et al. 2025).
"""
from __future__ import annotations

from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from pjit_ppo.models import scoring
from pjit_ppo.ppo.masked import masked_mean, masked_var


def aggregate(x: jax.Array, mask: jax.Array, how: str = "token_mean") -> jax.Array:
    """Per-token terms [batch, time] -> one scalar (ppo.loss_aggregation).

    "token_mean": mean over every counted token of the batch (long responses weigh
      more; PPO's and DAPO's token-level rule).
    "sequence_mean": mean over each sequence's counted tokens, then over sequences
      (the GRPO paper's 1/|o_i| normalisation).
    "sequence_sum": each sequence's sum over its counted tokens divided by the
      constant `time` (the response length), then mean over sequences: Dr. GRPO's
      length-independent normaliser (Liu et al. 2025), so a token's weight does not
      depend on its response's length.
    With every token counted the three are equal.

    Args:
      x: float [batch, time]; mask: bool/float [batch, time], 1 = counts.
    Returns:
      float scalar of x.dtype.
    """
    if how == "token_mean":
        return masked_mean(x, mask)
    if how == "sequence_mean":
        return jnp.mean(masked_mean(x, mask, axis=1))
    if how == "sequence_sum":
        kept = jnp.where(jnp.broadcast_to(mask, x.shape) != 0, x, jnp.zeros((), x.dtype))
        return jnp.mean(jnp.sum(kept, axis=1)) / x.shape[1]
    raise ValueError(f"loss aggregation {how!r}; choose 'token_mean', 'sequence_mean' or "
                     f"'sequence_sum'")


def policy_loss(
    new_logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cliprange,
    cliprange_high=None,
    importance_ratio: str = "token",
    aggregation: str = "token_mean",
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """Clipped-ratio PPO policy loss with decoupled clipping and a sequence-level ratio.

    Per token, max(-A * r, -A * clip(r, 1 - low, 1 + high)), aggregated by `aggregate`.

    - Decoupled clipping (DAPO's "clip-higher", Yu et al. 2025): low = `cliprange`,
      high = `cliprange_high` (None = `cliprange`); a larger upper range lets the
      probability of unlikely tokens with positive advantage grow faster.
    - `importance_ratio="sequence"` (GSPO, Zheng et al. 2025): every token of a
      sequence uses s = exp(mean over its counted tokens of (new - old)), the
      geometric mean of its token ratios, so clipping is decided per sequence. The
      gradient is GSPO-token's, s * grad(log pi(token)): with one advantage per
      sequence and "sequence_mean" aggregation this is exactly GSPO's objective.
      GSPO uses far smaller clip ranges than token-level PPO (3e-4 / 4e-4).

    Args:
      new_logprobs: float [batch, time] log pi_theta(a_t | s_t) of the sampled tokens.
      old_logprobs: float [batch, time] log-probs under the rollout policy.
      advantages: float [batch, time] (already normalised by the estimator).
      mask: bool/float [batch, time], 1 = token counts.
      cliprange: float scalar, the lower clip range (and the upper one unless given).
      cliprange_high: float scalar or None.
      importance_ratio: "token" or "sequence" (static).
      aggregation: "token_mean", "sequence_mean" or "sequence_sum" (static).

    Returns:
      (loss, stats): loss is a float scalar. stats are float scalars, masked means
      over tokens: ``approxkl`` 0.5 * (new - old)^2 (token log-ratios),
      ``clipfrac`` fraction of tokens where the clipped term is the larger one,
      ``clipfrac_low`` / ``clipfrac_high`` the part of it with r below 1 - low / above
      1 + high, ``ratio`` and ``ratio_var`` (population variance) of the ratio used,
      ``loss`` (= loss).
    """
    high = cliprange if cliprange_high is None else cliprange_high
    logratio = new_logprobs - old_logprobs
    if importance_ratio == "sequence":
        seq = jax.lax.stop_gradient(masked_mean(logratio, mask, axis=1))
        ratio = jnp.exp(seq[:, None] + new_logprobs - jax.lax.stop_gradient(new_logprobs))
    elif importance_ratio == "token":
        ratio = jnp.exp(logratio)
    else:
        raise ValueError(f"importance_ratio={importance_ratio!r}; choose 'token' or 'sequence'")
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * jnp.clip(ratio, 1.0 - cliprange, 1.0 + high)
    loss = aggregate(jnp.maximum(pg_losses, pg_losses2), mask, aggregation)
    clipped = pg_losses2 > pg_losses
    stats = {
        "loss": loss,
        "approxkl": 0.5 * masked_mean(jnp.square(logratio), mask),
        "clipfrac": masked_mean(clipped.astype(loss.dtype), mask),
        "clipfrac_low": masked_mean((clipped & (ratio < 1.0)).astype(loss.dtype), mask),
        "clipfrac_high": masked_mean((clipped & (ratio > 1.0)).astype(loss.dtype), mask),
        "ratio": masked_mean(ratio, mask),
        "ratio_var": masked_var(ratio, mask),
    }
    return loss, stats


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """Per-token k3 estimate of KL(pi || ref) (Schulman 2020, used by GRPO).

    exp(ref - logp) - (ref - logp) - 1: unbiased for samples from pi, never negative.
    float [batch, time] from float [batch, time] log-probs of the sampled tokens.
    """
    d = ref_logprobs - logprobs
    return jnp.exp(d) - d - 1.0


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
    low, high = cfg.clip_bounds
    pg_loss, pg = policy_loss(logprobs, mb.logprobs, mb.advantages, mask, low, high,
                              cfg.importance_ratio, cfg.loss_aggregation)
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


def _policy_terms(cfg, models, params, mb):
    """The clipped policy loss on the counted tokens, without any critic pass.

    Returns (current logprobs float32 [b, R], policy loss, stats named as metrics).
    """
    hidden = scoring.response_hidden(models.policy, params["policy"], mb.query, mb.query_mask,
                                     mb.response)
    logprobs, entropy = scoring.logprobs_from_hidden(models.policy, params["policy"], hidden,
                                                     mb.response, cfg.temperature,
                                                     with_entropy=True)
    low, high = cfg.clip_bounds
    pg_loss, pg = policy_loss(logprobs, mb.logprobs, mb.advantages, mb.mask, low, high,
                              cfg.importance_ratio, cfg.loss_aggregation)
    stats = {
        "ppo/policy/approxkl_avg": pg["approxkl"],
        "ppo/policy/clipfrac_avg": pg["clipfrac"],
        "ppo/policy/clipfrac_low_avg": pg["clipfrac_low"],
        "ppo/policy/clipfrac_high_avg": pg["clipfrac_high"],
        "ppo/policy/entropy_avg": masked_mean(entropy, mb.mask),
        "ppo/policy/ratio_avg": pg["ratio"],
        "ppo/loss/policy_avg": pg_loss,
    }
    return logprobs, pg_loss, stats


def policy_gradient_loss(cfg, models, params, mb) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """The critic-free loss ("rloo", "reinforce_pp"): the clipped policy loss alone.

    Args:
      cfg: PPOConfig; models: PPOModels (models.critic unused); params: {"policy": ...};
      mb: a RolloutBatch micro-batch [b, ...] with a token mask.
    Returns:
      (loss, stats) with float32 scalar stats named as the metrics they become.
    """
    _, loss, stats = _policy_terms(cfg, models, params, mb)
    stats["ppo/loss/total"] = loss
    return loss, stats


def grpo_loss(cfg, models, params, mb) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """GRPO's loss: the clipped policy loss + ppo.kl_loss_coef * the k3 KL to the reference.

    The KL term is aggregated like the policy term (ppo.loss_aggregation) over the
    same counted tokens. Args and returns as `policy_gradient_loss`; mb also carries
    ref_logprobs.
    """
    logprobs, pg_loss, stats = _policy_terms(cfg, models, params, mb)
    kl = aggregate(k3_kl(logprobs, mb.ref_logprobs), mb.mask, cfg.loss_aggregation)
    kl_term = cfg.kl_loss_coef * kl
    loss = pg_loss + kl_term
    stats.update({"ppo/loss/kl_avg": kl_term, "grpo/kl_k3_avg": kl, "ppo/loss/total": loss})
    return loss, stats
