"""Reward learning from preference labels: the loss, the reward model's scores over
N responses, normalisation of gain and bias, and the reward-model directory.

`pjit_ppo.reward_learning.train` runs the stage; these modules are its parts.
"""
from pjit_ppo.reward.loss import preference_loss
from pjit_ppo.reward.model import (REWARD_MODEL_INFO, load_reward_model, reward_scores,
                                   save_reward_model)
from pjit_ppo.reward.normalize import normalized_head

__all__ = ["preference_loss", "reward_scores", "save_reward_model", "load_reward_model",
           "REWARD_MODEL_INFO", "normalized_head"]
