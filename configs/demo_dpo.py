"""The demo's DPO stage (pjit_ppo/demo/configs.py): get_config("DIR[,quick]") with DIR the
demo's work directory (default /tmp/pjit_ppo_demo); `launch/demo.py --algo=dpo` (or
`--algo=all`) runs it after the SFT and labelling stages.

Run alone, e.g.: python launch/train_dpo.py --config=configs/demo_dpo.py:/tmp/pjit_ppo_demo \
    --workdir=/tmp/pjit_ppo_demo/dpo
"""
from pjit_ppo.demo import configs


def get_config(arg: str = ""):
    return configs.dpo(arg)
