"""PPO on your own model: any HF model directory or llama.cpp .gguf file, one option each.

  pjit-ppo-train --config=configs/hf_model.py --config.model.policy_path=DIR_OR_GGUF \
      --config.data.prompts_path=prompts.jsonl --workdir=runs/mine

What the recipe asks of you (everything else has a small default that fits one CPU or
one GPU; override any field with --config.a.b=v):
  model.policy_path   an HF model directory (config.json, safetensors, tokenizer files) or
                      a .gguf file: the policy, the frozen reference and the tokenizer
  data.prompts_path   JSONL ({"prompt": ...} per line), plain text (one prompt per line) or
                      a directory saved by HF datasets
  reward.path         a reward-model directory made by pjit-ppo-reward (see
                      configs/hf_reward.py); left empty, the reward is the policy's own trunk
                      with a random head, which runs but teaches nothing (a smoke test: the
                      log warns so)
The pad id, the stop token and truncation come from the tokenizer (ppo.pad_token_id = -1:
its pad token, or the first embedding row past its vocabulary; ppo.truncate_token = -1:
its EOS) unless you set them; prompts are used whole (no data.start_text / end_text).

Variants (:ARG, comma-separated): the estimator, in one word
  gae (default)                PPO with a critic (starts from the reward model's trunk when
                               reward.path is set, else from the policy)
  grpo, rloo, reinforce_pp     critic-free, 4 samples per prompt
and the common ones of configs/base.py: fsdp (default), dp, tpN.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  (configs/base.py)

from pjit_ppo.config import (FROM_TOKENIZER, CheckpointOptions, DataOptions,  # noqa: E402
                             MeshConfig, ModelOptions, PPOConfig, PPORunConfig, RewardOptions)

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp")


def _estimator(name: str):
    def apply(config: PPORunConfig) -> None:
        config.ppo.advantage_estimator = name
        if name != "gae":
            config.ppo.samples_per_prompt = 4
            config.ppo.loss_aggregation = "sequence_mean"
    return apply


def get_config(arg: str = "") -> PPORunConfig:
    config = PPORunConfig(
        model=ModelOptions(policy_path=""),
        reward=RewardOptions(kind="model", path="", allow_random_head=True),
        data=DataOptions(prompts_path="", prompts_format="auto", samples_every=5),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        checkpoint=CheckpointOptions(every=10, keep=2),
        ppo=PPOConfig(
            query_length=64, response_length=32, pad_token_id=FROM_TOKENIZER,
            truncate_token=FROM_TOKENIZER, truncate_after=0, temperature=0.7,
            batch_size=16, nminibatches=1, noptepochs=2, total_episodes=16 * 100,
            optimizer="adam", lr=1e-6, max_grad_norm=1.0, init_kl_coef=0.05,
            kl_controller="fixed", critic_init="reward"),
        num_iterations=20)
    base.apply_variants(config, arg, {name: _estimator(name) for name in ESTIMATORS})
    return config
