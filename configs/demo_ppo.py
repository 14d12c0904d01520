"""The demo's ppo stage (pjit_ppo/demo/configs.py): get_config("DIR[,quick]") with DIR the
demo's work directory (default /tmp/pjit_ppo_demo); launch/demo.py runs every stage.

Run alone, e.g.: python launch/train_ppo.py --config=configs/demo_ppo.py:/tmp/pjit_ppo_demo \
    --workdir=/tmp/pjit_ppo_demo/ppo
"""
from pjit_ppo.demo import configs


def get_config(arg: str = ""):
    return configs.ppo(arg)
