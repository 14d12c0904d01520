"""The demo's reward stage (pjit_ppo/demo/configs.py): get_config("DIR[,quick]") with DIR the
demo's work directory (default /tmp/pjit_ppo_demo); launch/demo.py runs every stage.

Run alone, e.g.: python launch/train_reward.py --config=configs/demo_reward.py:/tmp/pjit_ppo_demo \
    --workdir=/tmp/pjit_ppo_demo/reward
"""
from pjit_ppo.demo import configs


def get_config(arg: str = ""):
    return configs.reward(arg)
