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

With LoRA (model.lora.rank > 0) "policy" holds the policy's adapters; the reference
(frozen["ref"], the base in the compute dtype) is the base they sit on, so no fp32
policy is kept. A critic (estimators with one, not shared) is, with ppo.critic_lora
(the default), adapters + a value head on the frozen trunk of the reward model
(critic_init="reward": frozen["reward"]'s trunk) or of the base ("policy":
frozen["ref"]'s), no copy of either; with critic_lora=False a full fp32 critic as
without LoRA (from the policy: the base's copy in float32).

`make` is a `pjit_ppo.param_makers` maker: `Loaded(mesh)` for `pjit_ppo.ppo.run.build`
(arrays), `Abstract(mesh)` for `pjit_ppo.planning` (ShapeDtypeStructs with the same
shardings), so what the planner measures is what the run allocates.
"""
from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

from pjit_ppo import param_makers, rewards
from pjit_ppo.errors import ConfigError
from pjit_ppo.models import assemble as trees
from pjit_ppo.models import heads, lora
from pjit_ppo.ppo import lora_views
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


def trainable_params(ppo, policy_cfg, policy, reward: rewards.Reward, make, *,
                     frozen: Optional[Dict[str, Any]] = None):
    """(trainable tree, critic ModelConfig or None, critic base path or None) for
    ppo.advantage_estimator, ppo.shared_trunk, ppo.critic_init and, with LoRA
    (policy_cfg.lora; `policy` then the adapters, `frozen` the frozen models),
    ppo.critic_lora (see the module docstring)."""
    if not ppo.uses_critic:  # a critic-free estimator: nothing to build, train or save
        return {"policy": policy}, None, None
    if ppo.shared_trunk:
        return {"policy": policy,
                **make.replicated(lambda: heads.init_value_head(policy_cfg.d_model))}, None, None
    if ppo.critic_init == "reward" and reward.trunk is None:
        raise ConfigError("ppo.critic_init='reward' needs a reward with a model trunk; "
                          "use ppo.critic_init='policy'")
    spec = policy_cfg.lora
    if spec is not None and ppo.critic_lora:  # adapters on a frozen trunk, no copy of it
        if ppo.critic_init == "reward":
            base_path = lora_views.critic_base_path(frozen["reward"])
            critic_cfg = lora.with_adapters(reward.model, spec)
        else:
            base_path, critic_cfg = ("ref",), policy_cfg
        critic = param_makers.adapters(make, critic_cfg, ppo.seed, stream=1)
        critic.update(make.replicated(lambda: heads.init_value_head(critic_cfg.d_model)))
        return {"policy": policy, "critic": critic}, critic_cfg, base_path
    if ppo.critic_init == "reward":
        source, critic_cfg = reward.trunk, reward.model
    elif spec is not None:  # a full critic from the policy's base (its frozen copy)
        source, critic_cfg = frozen["ref"], lora.without_adapters(policy_cfg)
    else:
        source, critic_cfg = policy, policy_cfg
    critic = make.copy(trees.trunk_only(source), "float32" if spec is not None else None)
    critic.update(make.replicated(lambda: heads.init_value_head(critic_cfg.d_model)))
    return {"policy": policy, "critic": critic}, critic_cfg, None


def assemble(config, make, *, peak_flops: Optional[float] = None) -> Assembly:
    """The run of `config` (a PPORunConfig) on `make`'s mesh: models, trainer, state.

    With model.lora.rank > 0 the policy is its adapters, on the frozen base that is also
    the reference (`pjit_ppo.ppo.lora_views`). peak_flops: the devices' peak FLOP/s
    (summed) for MFU, or None.
    """
    ppo = config.ppo
    if config.model.lora.enabled:
        policy_cfg, base, policy = param_makers.adapted_lm(
            make, config.model, config.model.policy_path, ppo.seed)
        frozen: Dict[str, Any] = {"ref": base}
    else:
        policy_cfg, policy = make.lm(config.model, config.model.policy_path, ppo.seed)
        frozen = {"ref": make.copy(policy, policy_cfg.compute_dtype)}
    reward = rewards.build(config, make)
    frozen["reward"] = reward.params
    params, critic_cfg, critic_base = trainable_params(ppo, policy_cfg, policy, reward, make,
                                                       frozen=frozen)
    models = PPOModels(policy=policy_cfg, critic=critic_cfg, reward_fn=reward.fn,
                       critic_base=critic_base)
    trainer = PPOTrainer(ppo, models, make.mesh, num_updates=config.num_updates,
                         reward_flops=reward.flops, peak_flops=peak_flops)
    # The reward's fp32 trunk is dropped here (a critic from it holds its own copy).
    return Assembly(trainer, trainer.init_state(params, make), frozen, reward.model)
