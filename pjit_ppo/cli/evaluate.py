"""Evaluation entry point: `pjit-ppo-evaluate` or `python launch/evaluate.py`.

  pjit-ppo-evaluate --config=configs/tiny_demo.py --workdir=DIR [--step=N]

Restores only the policy of checkpoint N (latest complete by default), compares it
with the reference policy on held-out prompts, and writes DIR/eval/N/eval.json and
DIR/eval/N/samples.jsonl. `--config.evaluation.*` sets the number of prompts, the
temperature and greedy decoding.
"""
import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from pjit_ppo import distributed
from pjit_ppo.cli import common, flag_errors

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The run directory holding checkpoints/.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint iteration (default: latest complete).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    common.no_extra_args(argv)
    from pjit_ppo import preflight
    with common.config_errors():  # before devices, weights or compiles
        models = preflight.check_evaluate(_CONFIG.value, _WORKDIR.value)
    common.setup_jax()  # joins a multi-process run; the devices are known from here on
    with common.config_errors():
        preflight.check_devices(_CONFIG.value, models, evaluation=True)
    distributed.log_to_file(os.path.join(_WORKDIR.value, "logs"))  # once the launch is valid
    from pjit_ppo import evaluation
    with common.user_errors():
        result = evaluation.evaluate(_CONFIG.value, _WORKDIR.value, _STEP.value)
    print(json.dumps(result, indent=2), file=sys.stdout)


def run_main():
    common.tune_cpu_malloc()
    app.run(main, flags_parser=flag_errors.parse_flags)
