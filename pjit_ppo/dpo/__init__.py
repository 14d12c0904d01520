"""The DPO stage: direct preference optimisation (DPO, conservative DPO, IPO) of the policy
on the preference labels reward learning reads, against the initial policy as reference.

`train(config, workdir)` runs the stage and writes WORKDIR/model/, an HF directory that
PPO's `model.policy_path`, evaluation and export read; `dpo_loss` is the objective on
summed response log-probs.
"""
from pjit_ppo.dpo.loss import METRICS, dpo_loss, pair_losses
from pjit_ppo.dpo.pairs import preference_pairs
from pjit_ppo.dpo.reference import REFERENCE_FILE, pair_logps, reference_params
from pjit_ppo.dpo.train import MODEL_DIR, train

__all__ = ["train", "dpo_loss", "pair_losses", "METRICS", "preference_pairs", "pair_logps",
           "reference_params", "MODEL_DIR", "REFERENCE_FILE"]
