"""The math demo's GRPO stage (pjit_ppo/demo/math_configs.py): get_config("DIR[,quick]")
with DIR the math demo's work directory (default /tmp/pjit_ppo_demo_math), after its
model and data stages ran; launch/demo_math.py runs every stage.

Run alone, e.g.: python launch/train_ppo.py --config=configs/demo_math.py:/tmp/pjit_ppo_demo_math \
    --workdir=/tmp/pjit_ppo_demo_math/grpo
"""
from pjit_ppo.demo import math_configs


def get_config(arg: str = ""):
    return math_configs.grpo(arg)
