"""The verifiable-task demo: GRPO makes SmolLM2-135M-Instruct better at arithmetic (the
same as the `pjit-ppo-demo-math` console script).

  python launch/demo_math.py --workdir=/tmp/pjit_ppo_demo_math
"""
from pjit_ppo.cli import demo_math

if __name__ == "__main__":
    demo_math.run_main()
