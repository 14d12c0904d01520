"""pjit_ppo: PPO from human preferences for large language models with Haiku + pjit.

The public names are importable from here (`from pjit_ppo import RunConfig, train`)
and load their modules on first use, so `import pjit_ppo` alone does not start jax
(the CPU entry points re-exec themselves before jax is imported).
"""
import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it.
_EXPORTS = {
    # the run config
    "RunConfig": "pjit_ppo.config", "PPOConfig": "pjit_ppo.config",
    "MeshConfig": "pjit_ppo.config", "ModelOptions": "pjit_ppo.config",
    "RewardOptions": "pjit_ppo.config", "DataOptions": "pjit_ppo.config",
    "SamplingOptions": "pjit_ppo.config", "ConfigError": "pjit_ppo.config",
    # running PPO
    "train": "pjit_ppo.ppo.run", "build": "pjit_ppo.ppo.run",
    "PPOTrainer": "pjit_ppo.ppo.trainer", "PPOModels": "pjit_ppo.ppo.types",
    "TrainState": "pjit_ppo.ppo.types", "RolloutBatch": "pjit_ppo.ppo.types",
    # models
    "ModelConfig": "pjit_ppo.models.config", "load_pretrained": "pjit_ppo.models.hf",
    "save_pretrained": "pjit_ppo.models.hf", "init_params": "pjit_ppo.models.transformer",
    "lm_logits": "pjit_ppo.models.transformer",
    # sharding, sampling
    "make_mesh": "pjit_ppo.sharding", "init_sharded": "pjit_ppo.sharding",
    "generate": "pjit_ppo.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pjit_ppo' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
