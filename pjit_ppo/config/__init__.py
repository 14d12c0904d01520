"""Typed configs of every stage, in sections, each fact in one place.

A recipe file (`configs/*.py`) defines `get_config(arg="") -> <a stage config>`;
`ml_collections.config_flags.DEFINE_config_file` reads it and applies dotted overrides
(`--config.ppo.lr=1e-6`) to these dataclasses. Every field is documented where it is
defined; the classes use `__slots__`, so a misspelt field fails instead of being
ignored; `validate()` raises `ConfigError` naming the field, its value and the fix.
No module here imports jax (the launch pre-flight runs before it).

  checks.py    type, finiteness, range and choice checks every section uses
  sections.py  the shared sections: mesh, model (with its LoRA adapters), sampler, query/response sequences
               (SequenceOptions, declared once for PPO and reward learning), reward,
               prompts, checkpoints, evaluation, profiling
  ppo.py       PPOConfig (the `ppo` section) and PPORunConfig (a whole PPO run)
  sft.py       SFTConfig;  reward.py  RewardLearningConfig;  dpo.py  DPOConfig
  resume.py    which config changes a resumed run accepts
"""
from pjit_ppo.config.checks import check_field_types, check_values_finite
from pjit_ppo.config.ppo import (ADVANTAGE_ESTIMATORS, CRITIC_FREE_ESTIMATORS, CRITIC_INITS,
                                 GROUP_ESTIMATORS, IMPORTANCE_RATIOS, KL_CONTROLLERS,
                                 LOSS_AGGREGATIONS, PPOConfig, PPORunConfig, RunConfig)
from pjit_ppo.config.resume import RESUMABLE_CHANGES, json_round_trip, resume_conflicts
from pjit_ppo.config.dpo import DPO_LOSS_TYPES, DPOConfig
from pjit_ppo.config.reward import RewardLearningConfig
from pjit_ppo.config.sections import (COMPUTE_DTYPES, FROM_TOKENIZER, LORA_DEFAULT_TARGETS,
                                      LORA_PROJECTIONS, OPTIMIZERS, PROMPT_FORMATS, REWARD_KINDS,
                                      TOP_P_MODES, CheckpointOptions, DataOptions, EvalOptions,
                                      LoraOptions, MeshConfig, ModelOptions, ProfileOptions,
                                      RewardOptions, SamplingOptions, SequenceOptions)
from pjit_ppo.config.sft import CORPUS_FORMATS, LR_DECAYS, SFTConfig
from pjit_ppo.errors import ConfigError

__all__ = [
    "ConfigError", "check_field_types", "check_values_finite",
    "PPOConfig", "PPORunConfig", "RunConfig", "SFTConfig", "RewardLearningConfig", "DPOConfig",
    "SamplingOptions", "SequenceOptions", "MeshConfig", "ModelOptions", "RewardOptions",
    "DataOptions", "CheckpointOptions", "EvalOptions", "ProfileOptions", "LoraOptions",
    "LORA_PROJECTIONS", "LORA_DEFAULT_TARGETS",
    "RESUMABLE_CHANGES", "resume_conflicts", "json_round_trip",
    "FROM_TOKENIZER", "OPTIMIZERS", "TOP_P_MODES", "REWARD_KINDS", "COMPUTE_DTYPES", "PROMPT_FORMATS",
    "KL_CONTROLLERS", "CRITIC_INITS", "ADVANTAGE_ESTIMATORS", "CRITIC_FREE_ESTIMATORS",
    "GROUP_ESTIMATORS", "LOSS_AGGREGATIONS", "IMPORTANCE_RATIOS", "CORPUS_FORMATS",
    "LR_DECAYS", "DPO_LOSS_TYPES",
]
