"""lm-human-preferences' sentiment task at its defaults: GPT-2 124M continues 64-token
book excerpts with 24 tokens, rewarded by a reward model trained on human labels of
positive sentiment (Ziegler et al. 2019).

Files a real run reads (download / produce them first; override any path with
--config.model.policy_path=... etc.):
  models/gpt2/                      the HF "gpt2" checkpoint (config.json, model.safetensors,
                                    tokenizer files): the policy, the reference and the
                                    tokenizer (data.tokenizer_path "" = this directory)
  models/gpt2_sentiment_reward/     the reward model trained on the sentiment labels
                                    (launch/train_reward.py); the critic starts from its trunk
  data/books_prompts.jsonl          one {"text": ...} object per line: book passages; a query
                                    starts after the first '.' and ends at the last '.'
                                    (lm-human-preferences' start_text / end_text)

  python launch/train_ppo.py --config=configs/gpt2_sentiment.py --workdir=runs/sentiment
  python launch/train_ppo.py --config=configs/gpt2_sentiment.py:random --workdir=/tmp/smoke \
      --config.ppo.batch_size=16 --config.num_iterations=2     # no downloads

Variants (:ARG, comma-separated): random, fsdp, dp (configs/base.py; tpN does not fit GPT-2:
its 50257-row vocabulary, sharded over `tensor`, has no even split), and
  small     batch 64 in 2 minibatches, 50k episodes: a quick check on one device
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  (configs/base.py)

from pjit_ppo.config import DataOptions, RunConfig  # noqa: E402

#: Where the recipe expects its inputs (relative to the working directory).
POLICY_PATH = "models/gpt2"
REWARD_PATH = "models/gpt2_sentiment_reward"
PROMPTS_PATH = "data/books_prompts.jsonl"


def small(config: RunConfig) -> None:
    """A quick run: 64 episodes per iteration in 2 minibatches, 50k episodes."""
    config.ppo.batch_size, config.ppo.nminibatches = 64, 2
    config.ppo.total_episodes = 50_000


VARIANTS = {"small": small}


def get_config(arg: str = "") -> RunConfig:
    return base.recipe(
        shape=base.GPT2_124M, policy_path=POLICY_PATH, reward_path=REWARD_PATH,
        ppo=base.lm_human_preferences_ppo(),
        data=DataOptions(prompts_path=PROMPTS_PATH, prompts_format="jsonl", prompt_field="text",
                         start_text=".", end_text="."),
        arg=arg, variants=VARIANTS)
