"""The one assembly of a PPO run's models, trainer and state, for the real build and the
memory planner alike.

`assemble(config, make)` loads (or shapes) the policy, makes the frozen reference,
builds the reward of `reward.kind` (`pjit_ppo.rewards`), then the trainable tree the
estimator needs, and the trainer and its initial state:

  estimator with a critic, separate   {"policy", "critic"}: the critic is a copy of the
                                      reward model's trunk (ppo.critic_init="reward")
                                      or of the policy's ("policy") + a zero value head
  estimator with a critic, ppo.shared_trunk
                                      {"policy", "value_head"}: a value head on the policy
  critic-free estimator (grpo, ...)   {"policy"}

`make` is a `pjit_ppo.param_makers` maker: `Loaded(mesh)` for `pjit_ppo.ppo.run.build`
(arrays), `Abstract(mesh)` for `pjit_ppo.planning` (ShapeDtypeStructs with the same
shardings), so what the planner measures is what the run allocates.
"""
from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

from pjit_ppo import rewards
from pjit_ppo.errors import ConfigError
from pjit_ppo.models import assemble as trees
from pjit_ppo.models import heads
from pjit_ppo.ppo.trainer import PPOTrainer
from pjit_ppo.ppo.types import PPOModels, TrainState


class Assembly(NamedTuple):
    """A run's trainer, its initial state and its frozen models ({"ref", "reward"}),
    as arrays or abstract values (whichever `make` makes); `reward_model` is the
    reward's ModelConfig or None."""
    trainer: PPOTrainer
    state: TrainState
    frozen: Dict[str, Any]
    reward_model: Optional[Any]


def trainable_params(ppo, policy_cfg, policy, reward: rewards.Reward, make):
    """(trainable tree, critic ModelConfig or None) for ppo.advantage_estimator,
    ppo.shared_trunk and ppo.critic_init (see the module docstring)."""
    if not ppo.uses_critic:  # a critic-free estimator: nothing to build, train or save
        return {"policy": policy}, None
    if ppo.shared_trunk:
        return {"policy": policy,
                **make.replicated(lambda: heads.init_value_head(policy_cfg.d_model))}, None
    if ppo.critic_init == "reward":
        if reward.trunk is None:
            raise ConfigError("ppo.critic_init='reward' needs a reward with a model trunk; "
                              "use ppo.critic_init='policy'")
        source, critic_cfg = reward.trunk, reward.model
    else:
        source, critic_cfg = policy, policy_cfg
    critic = make.copy(trees.trunk_only(source))
    critic.update(make.replicated(lambda: heads.init_value_head(critic_cfg.d_model)))
    return {"policy": policy, "critic": critic}, critic_cfg


def assemble(config, make, *, peak_flops: Optional[float] = None) -> Assembly:
    """The run of `config` (a PPORunConfig) on `make`'s mesh: models, trainer, state.

    peak_flops: the devices' peak FLOP/s (summed) for MFU, or None.
    """
    ppo = config.ppo
    policy_cfg, policy = make.lm(config.model, config.model.policy_path, ppo.seed)
    frozen: Dict[str, Any] = {"ref": make.copy(policy, policy_cfg.compute_dtype)}
    reward = rewards.build(config, make)
    frozen["reward"] = reward.params
    params, critic_cfg = trainable_params(ppo, policy_cfg, policy, reward, make)
    models = PPOModels(policy=policy_cfg, critic=critic_cfg, reward_fn=reward.fn)
    trainer = PPOTrainer(ppo, models, make.mesh, num_updates=config.num_updates,
                         reward_flops=reward.flops, peak_flops=peak_flops)
    # The reward's fp32 trunk is dropped here (a critic from it holds its own copy).
    return Assembly(trainer, trainer.init_state(params, make), frozen, reward.model)
