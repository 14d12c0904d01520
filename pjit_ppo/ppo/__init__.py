"""Policy learning: collection, advantage estimators, losses, KL control, update, trainer.

The names users import are re-exported here; the modules behind them may move.
"""
from pjit_ppo.config import PPOConfig
from pjit_ppo.ppo import estimators, losses
from pjit_ppo.models.assemble import make_critic, make_frozen, trunk_only
from pjit_ppo.ppo.collect import collect
from pjit_ppo.ppo.estimators import (Estimator, gae, grpo_advantages, reinforce_pp_advantages,
                                     rloo_advantages, whiten)
from pjit_ppo.ppo.kl import kl_init, kl_update
from pjit_ppo.ppo.losses import (clipped_ppo_loss, grpo_loss, policy_gradient_loss, policy_loss,
                                 value_loss)
from pjit_ppo.rewards import model_reward_fn, target_token_reward
from pjit_ppo.ppo.rollout import rollout
from pjit_ppo.ppo.run import Job, build, train
from pjit_ppo.errors import NonFiniteError
from pjit_ppo.ppo.trainer import PPOTrainer, make_ppo_optimizer
from pjit_ppo.ppo.types import (Experience, PPOModels, PromptFn, RewardFn, RolloutBatch,
                                TrainState)
from pjit_ppo.ppo.update import epoch_permutations, update

__all__ = [
    "PPOConfig", "estimators", "losses", "make_critic", "make_frozen", "trunk_only", "collect",
    "Estimator", "gae", "whiten", "kl_init", "kl_update", "clipped_ppo_loss", "policy_loss",
    "value_loss", "model_reward_fn", "target_token_reward", "rollout", "Job", "build", "train",
    "NonFiniteError", "PPOTrainer", "make_ppo_optimizer", "Experience", "PPOModels", "PromptFn",
    "RewardFn", "RolloutBatch", "TrainState", "epoch_permutations", "update",
    "grpo_advantages", "rloo_advantages", "reinforce_pp_advantages", "policy_gradient_loss",
    "grpo_loss",
]
