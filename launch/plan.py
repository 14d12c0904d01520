"""Memory planner (the same as the `pjit-ppo-plan` console script).

  python launch/plan.py --config=configs/gptj_6b.py --devices=8 --device_memory=40GB
  python launch/plan.py --config=configs/gptj_6b.py:grpo --devices=8 --format=json
"""
from pjit_ppo.cli import plan

if __name__ == "__main__":
    plan.run_main()
