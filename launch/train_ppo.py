"""PPO training entry point (the same as the `pjit-ppo-train` console script).

  python launch/train_ppo.py --config=configs/tiny_demo.py --workdir=/tmp/demo
  python launch/train_ppo.py --config=configs/tiny_demo.py --workdir=DIR --config.ppo.lr=1e-3
"""
from pjit_ppo.cli import train_ppo

if __name__ == "__main__":
    train_ppo.run_main()
