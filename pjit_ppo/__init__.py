"""pjit_ppo: RLHF for large language models with Haiku + pjit: supervised fine-tuning,
reward learning from preferences and PPO (or a critic-free estimator), each a stage
with its own train function, on one sharded model code base.

The public names are importable from here (`from pjit_ppo import PPORunConfig, train_ppo`)
and load their modules on first use, so `import pjit_ppo` alone does not start jax
(the CPU entry points re-exec themselves before jax is imported).
"""
import importlib

__version__ = "0.1.0"

#: public name -> (module, attribute).
_EXPORTS = {
    # configs: one per stage, and the sections they share
    "PPORunConfig": ("pjit_ppo.config", "PPORunConfig"),
    "PPOConfig": ("pjit_ppo.config", "PPOConfig"),
    "SFTConfig": ("pjit_ppo.config", "SFTConfig"),
    "RewardLearningConfig": ("pjit_ppo.config", "RewardLearningConfig"),
    "DPOConfig": ("pjit_ppo.config", "DPOConfig"),
    "MeshConfig": ("pjit_ppo.config", "MeshConfig"),
    "ModelOptions": ("pjit_ppo.config", "ModelOptions"),
    "RewardOptions": ("pjit_ppo.config", "RewardOptions"),
    "DataOptions": ("pjit_ppo.config", "DataOptions"),
    "CheckpointOptions": ("pjit_ppo.config", "CheckpointOptions"),
    "EvalOptions": ("pjit_ppo.config", "EvalOptions"),
    "SamplingOptions": ("pjit_ppo.config", "SamplingOptions"),
    "SequenceOptions": ("pjit_ppo.config", "SequenceOptions"),
    # the errors a user can cause
    "ConfigError": ("pjit_ppo.errors", "ConfigError"),
    "DataError": ("pjit_ppo.errors", "DataError"),
    "CheckpointError": ("pjit_ppo.errors", "CheckpointError"),
    "NonFiniteError": ("pjit_ppo.errors", "NonFiniteError"),
    # the stages, their evaluation, export and planning
    "train_sft": ("pjit_ppo.sft", "train"),
    "train_reward_model": ("pjit_ppo.reward", "train"),
    "train_dpo": ("pjit_ppo.dpo", "train"),
    "train_ppo": ("pjit_ppo.ppo.run", "train"),
    "build_ppo": ("pjit_ppo.ppo.run", "build"),
    "evaluate_ppo": ("pjit_ppo.evaluation", "evaluate"),
    "export_policy": ("pjit_ppo.export", "export_policy"),
    "plan_ppo": ("pjit_ppo.planning", "plan"),
    "PPOTrainer": ("pjit_ppo.ppo.trainer", "PPOTrainer"),
    "PPOModels": ("pjit_ppo.ppo.types", "PPOModels"),
    "TrainState": ("pjit_ppo.ppo.types", "TrainState"),
    "RolloutBatch": ("pjit_ppo.ppo.types", "RolloutBatch"),
    # models
    "ModelConfig": ("pjit_ppo.models.config", "ModelConfig"),
    "load_pretrained": ("pjit_ppo.models.hf", "load_pretrained"),
    "save_pretrained": ("pjit_ppo.models.hf", "save_pretrained"),
    "init_params": ("pjit_ppo.models.transformer", "init_params"),
    "lm_logits": ("pjit_ppo.models.transformer", "lm_logits"),
    # sharding, sampling
    "make_mesh": ("pjit_ppo.sharding", "make_mesh"),
    "init_sharded": ("pjit_ppo.sharding", "init_sharded"),
    "generate": ("pjit_ppo.sampling", "generate"),
}
#: Earlier names, kept so code written against them runs: RunConfig is PPORunConfig,
#: train / build are train_ppo / build_ppo.
_ALIASES = {"RunConfig": "PPORunConfig", "train": "train_ppo", "build": "build_ppo"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    public = _ALIASES.get(name, name)
    if public in _EXPORTS:
        module, attribute = _EXPORTS[public]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pjit_ppo' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__ + list(_ALIASES))
