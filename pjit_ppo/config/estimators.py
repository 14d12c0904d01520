"""The advantage estimators (`ppo.advantage_estimator`): one table, jax-free.

Each entry names the estimator's functions by "module:function" (they need jax and
live in `pjit_ppo.ppo`: `pjit_ppo.ppo.estimators` looks them up from this table) and
states the facts the config checks before jax starts. The config's choices
(ADVANTAGE_ESTIMATORS, CRITIC_FREE_ESTIMATORS, GROUP_ESTIMATORS) are derived from it.

Adding an estimator: write its advantages function (cfg, Experience, kl_coef) ->
(advantages [B, R], returns [B, R] or None, metrics), in `pjit_ppo/ppo/estimators.py`
or a new module, pick or write its loss (`pjit_ppo/ppo/losses.py`), and add one line
to ESTIMATORS below. What each estimator computes: `pjit_ppo/ppo/estimators.py` and
docs/semantics.md.
"""
import dataclasses
from typing import Dict


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """One estimator, by name.

    advantages: "module:function", (cfg, Experience, kl_coef) -> (advantages [B, R],
      returns [B, R] or None, metrics).
    loss: "module:function", (cfg, models, params, RolloutBatch micro-batch) ->
      (scalar loss, stats).
    uses_critic: the run builds and trains a critic (values in Experience and
      RolloutBatch, a value loss).
    min_samples_per_prompt: the advantages compare the samples of a prompt and need
      ppo.samples_per_prompt >= this.
    kl_in_reward: the KL penalty with the controller's coefficient is part of the reward
      (the controller adapts it and `objective/kl_coef` is logged); otherwise the KL
      coefficient state is left unchanged.
    masks_after_stop: only the tokens up to and including the stop token count
      (`Experience.mask`); otherwise every response token does (the reference rule).
    loss_uses_ref: the loss needs the reference log-probs (`RolloutBatch.ref_logprobs`).
    """
    advantages: str
    loss: str
    uses_critic: bool
    min_samples_per_prompt: int = 1
    kl_in_reward: bool = True
    masks_after_stop: bool = False
    loss_uses_ref: bool = False


_EST = "pjit_ppo.ppo.estimators:"
_LOSS = "pjit_ppo.ppo.losses:"

#: ppo.advantage_estimator -> its spec. One line per estimator.
ESTIMATORS: Dict[str, EstimatorSpec] = {
    "gae": EstimatorSpec(_EST + "gae_advantages", _LOSS + "clipped_ppo_loss", uses_critic=True),
    "grpo": EstimatorSpec(_EST + "grpo_estimator", _LOSS + "grpo_loss", uses_critic=False,
                          min_samples_per_prompt=2, kl_in_reward=False, masks_after_stop=True,
                          loss_uses_ref=True),
    "rloo": EstimatorSpec(_EST + "rloo_estimator", _LOSS + "policy_gradient_loss",
                          uses_critic=False, min_samples_per_prompt=2, masks_after_stop=True),
    "reinforce_pp": EstimatorSpec(_EST + "reinforce_pp_estimator",
                                  _LOSS + "policy_gradient_loss", uses_critic=False,
                                  masks_after_stop=True),
}
