"""Checkpoint evaluation entry point (the same as the `pjit-ppo-evaluate` console script).

  python launch/evaluate.py --config=configs/tiny_demo.py --workdir=DIR [--step=N]
"""
from pjit_ppo.cli import evaluate

if __name__ == "__main__":
    evaluate.run_main()
