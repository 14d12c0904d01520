"""lm-human-preferences' descriptiveness task at its defaults: GPT-2 124M continues
64-token book excerpts with 24 tokens, rewarded by a reward model trained on human labels
of vividly descriptive continuations (Ziegler et al. 2019). The same task and PPO
settings as configs/gpt2_sentiment.py; only the reward model differs.

Files a real run reads (override any path with --config.model.policy_path=... etc.):
  models/gpt2/                         the HF "gpt2" checkpoint with its tokenizer files
  models/gpt2_descriptiveness_reward/  the reward model trained on the descriptiveness
                                       labels (launch/train_reward.py); the critic starts
                                       from its trunk
  data/books_prompts.jsonl             one {"text": ...} object per line: book passages

  python launch/train_ppo.py --config=configs/gpt2_descriptiveness.py --workdir=runs/desc

Variants (:ARG, comma-separated): random, fsdp, dp (configs/base.py), small.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  (configs/base.py)
import gpt2_sentiment  # noqa: E402  (the same task)

from pjit_ppo.config import RunConfig  # noqa: E402

POLICY_PATH = gpt2_sentiment.POLICY_PATH
REWARD_PATH = "models/gpt2_descriptiveness_reward"
PROMPTS_PATH = gpt2_sentiment.PROMPTS_PATH
VARIANTS = gpt2_sentiment.VARIANTS


def get_config(arg: str = "") -> RunConfig:
    config = gpt2_sentiment.get_config()
    config.reward.path = REWARD_PATH
    return base.apply_variants(config, arg, VARIANTS)
