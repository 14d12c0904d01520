"""Reward learning on your own model: a reward model from a preference file, for the PPO
run of configs/hf_model.py.

  pjit-ppo-reward --config=configs/hf_reward.py --config.model.policy_path=DIR_OR_GGUF \
      --config.labels_path=labels.jsonl --workdir=runs/reward
  pjit-ppo-train --config=configs/hf_model.py --config.model.policy_path=DIR_OR_GGUF \
      --config.reward.path=runs/reward/reward_model --config.data.prompts_path=... ...

labels_path: JSONL preference labels, best-of-N {"query", "responses", "choice"} or
pairwise {"query", "chosen", "rejected"}. The reward model starts from the policy
(model.policy_path) and its normalisation samples come from it.

The sequence fields (query_length, response_length, pad and stop ids, sampling) are
taken from configs/hf_model.py's PPO section, not copied: change them there (or pass the
same overrides to both commands). The same :ARG variants as hf_model.py are accepted.
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_model  # noqa: E402  (configs/hf_model.py)

from pjit_ppo.config import (CheckpointOptions, ModelOptions,  # noqa: E402
                             RewardLearningConfig, SequenceOptions)


def get_config(arg: str = "") -> RewardLearningConfig:
    ppo_run = hf_model.get_config(arg)
    shared = {f.name: getattr(ppo_run.ppo, f.name) for f in dataclasses.fields(SequenceOptions)}
    return RewardLearningConfig(
        model=ModelOptions(policy_path=""), mesh=ppo_run.mesh,
        checkpoint=CheckpointOptions(every=50, keep=2), labels_path="",
        batch_size=16, num_epochs=1, lr=1e-5, optimizer="adam", norm_samples=64,
        norm_batch_size=16, **shared)
