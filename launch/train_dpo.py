"""DPO entry point (the same as the `pjit-ppo-dpo` console script).

  python launch/train_dpo.py --config=configs/RECIPE.py --workdir=/tmp/dpo
  python launch/train_dpo.py --config=configs/RECIPE.py --workdir=DIR --config.beta=0.05
"""
from pjit_ppo.cli import train_dpo

if __name__ == "__main__":
    train_dpo.run_main()
