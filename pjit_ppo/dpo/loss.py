"""The DPO objective on summed response log-probs: DPO (sigmoid), conservative DPO
(label smoothing) and IPO, with the metrics named as TRL's DPOTrainer logs them.

With the log-ratios of the policy to the reference, h = (log pi(y_w) - log pi_ref(y_w))
- (log pi(y_l) - log pi_ref(y_l)) for chosen y_w and rejected y_l:

  sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps = label_smoothing)
  ipo      (h - 1 / (2 beta))^2

The implicit reward of a response is beta (log pi - log pi_ref). IPO here takes the
summed log-probs as given (TRL's DPOTrainer divides them by the response length for IPO).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

#: The metrics of a batch of pairs, in the order they are logged.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def pair_losses(policy_chosen_logps: jax.Array, policy_rejected_logps: jax.Array,
                ref_chosen_logps: jax.Array, ref_rejected_logps: jax.Array, *, beta: float,
                loss_type: str = "sigmoid", label_smoothing: float = 0.0
                ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """The loss and metrics of each pair (see `dpo_loss`): float32 [B] and {name: float32
    [B]} for every name in METRICS."""
    if loss_type not in ("sigmoid", "ipo"):
        raise ValueError(f"loss_type={loss_type!r}; choose 'sigmoid' or 'ipo'")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError("label_smoothing applies to loss_type='sigmoid' only")
    pc, pr, rc, rr = (jnp.asarray(x, jnp.float32) for x in (
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps))
    chosen_ratio, rejected_ratio = pc - rc, pr - rr
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        loss = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h)
                - label_smoothing * jax.nn.log_sigmoid(-beta * h))
    else:
        loss = jnp.square(h - 1.0 / (2.0 * beta))
    chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
    metrics = {
        "rewards/chosen": chosen_reward,
        "rewards/rejected": rejected_reward,
        "rewards/accuracies": (chosen_reward > rejected_reward).astype(jnp.float32),
        "rewards/margins": chosen_reward - rejected_reward,
        "logps/chosen": pc,
        "logps/rejected": pr,
    }
    return loss, metrics


def dpo_loss(policy_chosen_logps: jax.Array, policy_rejected_logps: jax.Array,
             ref_chosen_logps: jax.Array, ref_rejected_logps: jax.Array, *, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             weight: Optional[jax.Array] = None) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """The DPO / IPO loss of a batch of preference pairs.

    Args:
      policy_chosen_logps, policy_rejected_logps: float [B], the policy's log-probability
        of each pair's chosen / rejected response given its query (summed over the
        response tokens).
      ref_chosen_logps, ref_rejected_logps: float [B], the same under the reference.
      beta: > 0, the weight of the implicit KL term (the reward scale).
      loss_type: "sigmoid" (DPO) or "ipo".
      label_smoothing: sigmoid only, in [0, 0.5): the conservative DPO's share of labels
        assumed flipped (0 = DPO).
      weight: optional float [B] weights of the pairs (0 drops a pair); default all 1.
    Returns:
      (loss: float32 scalar, the weighted mean over pairs; metrics: {name: float32
      scalar}, the weighted means of "rewards/chosen", "rewards/rejected" (beta times
      the log-ratio of policy to reference), "rewards/accuracies" (share of pairs whose
      chosen reward is the higher), "rewards/margins" (chosen minus rejected reward),
      "logps/chosen", "logps/rejected" (the policy's log-probs)).
    """
    loss, per_pair = pair_losses(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
                                 ref_rejected_logps, beta=beta, loss_type=loss_type,
                                 label_smoothing=label_smoothing)
    w = jnp.ones_like(loss) if weight is None else jnp.asarray(weight, jnp.float32)
    total = jnp.maximum(jnp.sum(w), 1e-12)

    def mean(x):
        return jnp.sum(x * w) / total
    return mean(loss), {name: mean(value) for name, value in per_pair.items()}
