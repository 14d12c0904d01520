"""The embedded RLHF demo (the same as the `pjit-ppo-demo` console script).

  python launch/demo.py --workdir=/tmp/pjit_ppo_demo
"""
from pjit_ppo.cli import demo

if __name__ == "__main__":
    demo.run_main()
