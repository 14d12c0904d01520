"""PPO on Llama-2-7B with the lm-human-preferences task settings (64-token queries,
24-token responses, batch 512, adaptive KL, TF-style Adam at lr 1e-5), laid out for
8 accelerators with 80 GB each.

Memory: the policy and the critic train with float32 weights and Adam moments (16 bytes
per parameter each, ~216 GB for the two), the reference and the reward model are
frozen in bfloat16 (~27 GB), all FSDP-sharded over every device. Activations are
bfloat16 and recomputed per layer (remat "full"); the update runs in 8 micro-batches and
the rollout samples 64 episodes at a time, so activations and the KV cache stay small.
Check a layout before launching: python launch/plan.py --config=configs/llama_7b.py.

Llama's tokenizer has no pad token and every id below 32000 is text, so the pad id is
32000 (outside the vocabulary, never embedded); '.' is id 29889.

Files a real run reads (override with --config.model.policy_path=... etc.):
  models/llama-2-7b/         the HF "meta-llama/Llama-2-7b-hf" checkpoint (safetensors)
                             with its tokenizer
  models/llama-2-7b_reward/  a reward model on the same tokenizer (launch/train_reward.py)
  data/books_prompts.jsonl   one {"text": ...} object per line

  python launch/train_ppo.py --config=configs/llama_7b.py --workdir=runs/llama7b

Variants (:ARG, comma-separated): random, fsdp, dp, tpN (configs/base.py; tp2..tp32 divide
its heads), and
  16dev     16 devices (2 hosts of 8): micro-batches of 32 episodes per device group
  grpo      critic-free GRPO, 64 prompts x 8 samples, query 256, response 256
  lora      LoRA adapters (rank 16) on the policy (and a critic); base = reference
            (lora,grpo: one 80 GB device)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  (configs/base.py)

from pjit_ppo.config import DataOptions, RunConfig  # noqa: E402

POLICY_PATH = "models/llama-2-7b"
REWARD_PATH = "models/llama-2-7b_reward"
PROMPTS_PATH = "data/books_prompts.jsonl"
#: Llama tokenizer ids: '.' (stop / truncation token); the pad id is outside the vocabulary.
PERIOD_ID, PAD_ID = 29889, 32000


def sixteen_devices(config: RunConfig) -> None:
    """Two hosts of 8: the same batch, half the gradient-accumulation steps per device."""
    config.ppo.gradient_accumulation_steps = 4


def grpo(config: RunConfig) -> None:
    """Critic-free GRPO: 64 prompts x 8 samples (batch 512), 256-token queries and
    256-token responses, the KL as a loss term, sequence-mean loss."""
    config.ppo.advantage_estimator = "grpo"
    config.ppo.samples_per_prompt = 8
    config.ppo.loss_aggregation = "sequence_mean"
    config.ppo.kl_loss_coef = 0.04
    config.ppo.query_length, config.ppo.response_length = 256, 256
    config.ppo.truncate_after = 16


def lora(config: RunConfig) -> None:
    """LoRA (rank 16, alpha 32) on every attention and MLP projection: the bf16 base is
    the reference too (13.5 GB once), the reward model frozen in bf16; with "grpo" one
    80 GB device holds the run (python launch/plan.py --config=configs/llama_7b.py:lora,grpo
    --devices=1 --device_memory=80GB)."""
    base.use_lora(rank=16, alpha=32.0)(config)


VARIANTS = {"16dev": sixteen_devices, "grpo": grpo, "lora": lora}


def get_config(arg: str = "") -> RunConfig:
    return base.recipe(
        shape=base.LLAMA2_7B, policy_path=POLICY_PATH, reward_path=REWARD_PATH,
        ppo=base.lm_human_preferences_ppo(truncate_token=PERIOD_ID, pad_token_id=PAD_ID,
                                          gradient_accumulation_steps=8,
                                          rollout_micro_batch_size=64),
        data=DataOptions(prompts_path=PROMPTS_PATH, prompts_format="jsonl", prompt_field="text",
                         start_text=".", end_text="."),
        compute_dtype="bfloat16", remat_policy="full", arg=arg, variants=VARIANTS)
