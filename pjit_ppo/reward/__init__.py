"""The reward-learning stage: a reward model trained from preference labels
(lm-human-preferences' train_reward), its loss and the normalisation of its gain and bias.

`train(config, workdir)` runs the stage and writes WORKDIR/reward_model/, a reward-model
directory (`pjit_ppo.models.reward_model`) that PPO's `reward.kind="model"` reads.
"""
from pjit_ppo.reward.loss import preference_loss
from pjit_ppo.reward.normalize import normalized_head
from pjit_ppo.reward.train import train

__all__ = ["train", "preference_loss", "normalized_head"]
