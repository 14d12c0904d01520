"""Reward learning entry point (the same as the `pjit-ppo-reward` console script).

  python launch/train_reward.py --config=configs/RECIPE.py --workdir=/tmp/rm
  python launch/train_reward.py --config=configs/RECIPE.py --workdir=DIR \
      --config.labels_path=labels.jsonl
"""
from pjit_ppo.cli import train_reward

if __name__ == "__main__":
    train_reward.run_main()
