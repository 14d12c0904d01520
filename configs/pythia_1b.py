"""PPO on Pythia-1B (GPT-NeoX) with the lm-human-preferences task settings: 64-token
queries, 24-token responses, batch 512, adaptive KL, TF-style Adam at lr 1e-5.

Pythia uses the GPT-NeoX tokenizer: '.' is id 15 (the truncation token) and
<|padding|> (id 1) is its pad token. Activations in bfloat16 (accelerators); the
trained policy and critic keep float32 master weights, the reference and reward are
stored in bfloat16.

Files a real run reads (override with --config.model.policy_path=... etc.):
  models/pythia-1b/          the HF "EleutherAI/pythia-1b" checkpoint with its tokenizer
  models/pythia-1b_reward/   a reward model on the same tokenizer (launch/train_reward.py)
  data/books_prompts.jsonl   one {"text": ...} object per line

  python launch/train_ppo.py --config=configs/pythia_1b.py --workdir=runs/pythia1b
  python launch/train_ppo.py --config=configs/pythia_1b.py:random,tp2 --workdir=/tmp/p

Variants (:ARG, comma-separated): random, fsdp, dp, tpN (configs/base.py; tp2, tp4
and tp8 divide its 8 heads), and
  remat     recompute each layer in the backward pass (less activation memory)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  (configs/base.py)

from pjit_ppo.config import DataOptions, RunConfig  # noqa: E402

POLICY_PATH = "models/pythia-1b"
REWARD_PATH = "models/pythia-1b_reward"
PROMPTS_PATH = "data/books_prompts.jsonl"
#: GPT-NeoX tokenizer ids: '.' (stop / truncation token) and <|padding|>.
PERIOD_ID, PAD_ID = 15, 1


def remat(config: RunConfig) -> None:
    """Recompute every layer's activations in the backward pass."""
    config.model.remat_policy = "full"


VARIANTS = {"remat": remat}


def get_config(arg: str = "") -> RunConfig:
    return base.recipe(
        shape=base.PYTHIA_1B, policy_path=POLICY_PATH, reward_path=REWARD_PATH,
        ppo=base.lm_human_preferences_ppo(truncate_token=PERIOD_ID, pad_token_id=PAD_ID),
        data=DataOptions(prompts_path=PROMPTS_PATH, prompts_format="jsonl", prompt_field="text",
                         start_text=".", end_text="."),
        compute_dtype="bfloat16", arg=arg, variants=VARIANTS)
