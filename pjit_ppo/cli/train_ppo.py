"""PPO training entry point: `pjit-ppo-train` or `python launch/train_ppo.py`.

  pjit-ppo-train --config=configs/tiny_demo.py --workdir=/tmp/demo
  pjit-ppo-train --config=configs/tiny_demo.py --workdir=DIR --config.ppo.lr=1e-3

`--config` is a recipe file defining `get_config(arg="") -> RunConfig`
(`--config=FILE:ARG` passes ARG); `--config.a.b=v` overrides any field. Running the
same command again on the same work directory resumes from its latest complete
checkpoint. SIGTERM / SIGINT: finish the iteration, save, exit 0.

Several processes (hosts), one command per process (WORKSPACE.md, "Running on a pod /
SLURM"; under SLURM the process flags come from the environment):

  pjit-ppo-train --config=... --workdir=SHARED_DIR --coordinator_address=host0:1234 \
      --num_processes=2 --process_id=I
"""
import os

from absl import app, flags, logging
from ml_collections import config_flags

from pjit_ppo import distributed
from pjit_ppo.cli import common, flag_errors

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (get_config).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config.json, metrics.jsonl, "
                                                "tensorboard/ and checkpoints/ are written "
                                                "there; the same command again resumes.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    common.no_extra_args(argv)
    config, workdir = _CONFIG.value, _WORKDIR.value
    from pjit_ppo import preflight
    with common.config_errors():  # before devices, weights or compiles; nothing written
        models = preflight.check_train(config, workdir)
    common.setup_jax()  # joins a multi-process run; the devices are known from here on
    with common.config_errors():
        preflight.check_devices(config, models)
    from pjit_ppo.ppo import run
    with common.fresh_workdir_removed_if_refused(workdir):
        distributed.log_to_file(os.path.join(workdir, "logs"))  # once the launch is valid
        with common.user_errors():
            last = run.train(_CONFIG.value, _WORKDIR.value)
    if last:
        logging.info("final metrics: %s", {k: round(v, 4) for k, v in sorted(last.items())
                                           if k != "preempted"})


def run_main():
    """The console script: CPU malloc tuning (re-exec once), then the absl app."""
    common.tune_cpu_malloc()
    app.run(main, flags_parser=flag_errors.parse_flags)
