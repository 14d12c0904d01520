"""GPT-J-6B PPO on 8 x A100-40GB: policy and a separate critic trained with Adam (fp32
parameters and moments, FSDP over the 8 devices), reference and reward model frozen in
bf16, bf16 compute, full rematerialisation; the lm-human-preferences reference batch
(512 episodes, query 64, response 24).

The model's shapes come from GPT-J-6B's HF config.json, written below, so planning and
random-init smoke runs need no download. A real run points model.policy_path (and
reward.path) at the downloaded directories.

  python launch/plan.py --config=configs/gptj_6b.py --devices=8 --device_memory=40GB
  python launch/train_ppo.py --config=configs/gptj_6b.py --workdir=DIR \
      --config.model.policy_path=/models/gpt-j-6b --config.reward.path=/models/reward

Variants (--config=configs/gptj_6b.py:ARG, comma-separated; also fsdp, dp, tpN from
configs/base.py):
  ""      PPO with GAE and a separate critic (from the reward model's trunk)
  "grpo"  critic-free GRPO, 4 samples per prompt (128 prompts x 4), no critic at all
  "lora"  LoRA adapters (rank 16) on the policy and the critic; base = reference, reward
          frozen: python launch/plan.py --config=configs/gptj_6b.py:lora --devices=8
          --device_memory=16GB

Memory options (per device; the planner's figures, dated, are in docs/performance.md):
  ppo.gradient_accumulation_steps  the update's micro-batch = 512 / this: 64 -> 8 episodes
                                   (one per device; peak 31.6 GiB). 8 -> micro-batches of 64
                                   also fit 40 GB (33.6 GiB) and use the GPUs better
  ppo.rollout_micro_batch_size     the rollout samples and scores 64 episodes at a time
  model.remat_policy="full"        each layer's activations recomputed in the backward
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  (configs/base.py)

from pjit_ppo.config import DataOptions, RunConfig  # noqa: E402

#: GPT-J-6B's config.json (EleutherAI/gpt-j-6b), the fields the model needs.
GPTJ_6B = {
    "architectures": ["GPTJForCausalLM"],
    "model_type": "gptj",
    "vocab_size": 50400,
    "n_positions": 2048,
    "n_embd": 4096,
    "n_layer": 28,
    "n_head": 16,
    "rotary_dim": 64,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
}
#: A dedicated pad id (not EOS): GPT-J's embedding has 50400 rows and text tokenises to
#: ids below 50257, so the last row is never a text token.
PAD_ID = 50399


def grpo(config: RunConfig) -> None:
    """Critic-free GRPO: 128 prompts x 4 samples, KL as a loss term, no critic at all."""
    config.ppo.advantage_estimator = "grpo"
    config.ppo.samples_per_prompt = 4
    config.ppo.loss_aggregation = "sequence_mean"
    config.ppo.kl_loss_coef = 0.04


def lora(config: RunConfig) -> None:
    """LoRA (rank 16, alpha 32) on the policy's and the critic's attention and MLP
    projections: the policy's bf16 base is also the reference, the critic's adapters sit
    on the frozen reward model's trunk, the reward model is frozen; fp32 weights and Adam
    moments only for the adapters and the value head. Fits 8 x 16 GB at batch 512."""
    base.use_lora(rank=16, alpha=32.0)(config)


VARIANTS = {"grpo": grpo, "lora": lora}


def get_config(arg: str = "") -> RunConfig:
    config = base.recipe(
        shape=GPTJ_6B, policy_path="", reward_path="",
        ppo=base.lm_human_preferences_ppo(gradient_accumulation_steps=64,
                                          rollout_micro_batch_size=64, pad_token_id=PAD_ID),
        data=DataOptions(), compute_dtype="bfloat16", remat_policy="full", arg=arg,
        variants=VARIANTS)
    config.measure_peak = False
    return config
