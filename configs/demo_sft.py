"""The demo's sft stage (pjit_ppo/demo/configs.py): get_config("DIR[,quick]") with DIR the
demo's work directory (default /tmp/pjit_ppo_demo); launch/demo.py runs every stage.

Run alone, e.g.: python launch/train_sft.py --config=configs/demo_sft.py:/tmp/pjit_ppo_demo \
    --workdir=/tmp/pjit_ppo_demo/sft
"""
from pjit_ppo.demo import configs


def get_config(arg: str = ""):
    return configs.sft(arg)
