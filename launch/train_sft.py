"""Supervised fine-tuning entry point (the same as the `pjit-ppo-sft` console script).

  python launch/train_sft.py --config=configs/RECIPE.py --workdir=/tmp/sft
  python launch/train_sft.py --config=configs/RECIPE.py --workdir=DIR --config.lr=3e-4
"""
from pjit_ppo.cli import train_sft

if __name__ == "__main__":
    train_sft.run_main()
