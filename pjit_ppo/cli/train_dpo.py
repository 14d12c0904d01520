"""DPO entry point: `pjit-ppo-dpo` or `python launch/train_dpo.py`.

  pjit-ppo-dpo --config=configs/RECIPE.py --workdir=/tmp/dpo
  pjit-ppo-dpo --config=configs/RECIPE.py --workdir=DIR --config.beta=0.05 \
      --config.labels_path=labels.jsonl --config.model.policy_path=/models/sft

`--config` is a recipe file defining `get_config(arg="") -> DPOConfig`
(pjit_ppo/config/dpo.py); `--config.a.b=v` overrides any field. Writes
WORKDIR/config.json, reference_logps.npz, metrics.jsonl, tensorboard/,
checkpoints/<step>/ and the trained policy as an HF directory in WORKDIR/model/ (with
the tokenizer; PPO's model.policy_path reads it). A bad config, a bad label record
(named by file and line) or a bad tokenizer is one line on stderr and exit status 2.

Re-running the same command on the same WORKDIR resumes from the latest complete
checkpoint and ends as an uninterrupted run would (a config that changes what the
run computes is refused: one line, exit status 2). SIGTERM / SIGINT: the current step
finishes, a checkpoint is saved, exit status 0.
"""
from absl import app, flags, logging
from ml_collections import config_flags

from pjit_ppo.cli import common, flag_errors

_CONFIG = config_flags.DEFINE_config_file("config", None, "DPO config file (get_config).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config.json, metrics.jsonl, "
                                                "tensorboard/ and model/ are written there.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    common.no_extra_args(argv)
    config, workdir = _CONFIG.value, _WORKDIR.value
    from pjit_ppo import preflight
    with common.user_errors():  # ConfigError / DataError: one line, exit 2; nothing written
        preflight.check_dpo(config, workdir)
    common.setup_jax()
    from pjit_ppo import dpo
    with common.fresh_workdir_removed_if_refused(workdir):
        with common.user_errors():
            out = dpo.train(config, workdir)
    if out.get("preempted"):
        return  # the loop logged where it stopped and saved; exit status 0
    logging.info("DPO done: held-out loss %.4f -> %.4f, reward accuracy %.3f, model in %s",
                 out["test/loss_initial"], out["test/loss"], out["test/rewards/accuracies"],
                 out["model_dir"])


def run_main():
    """The console script: CPU malloc tuning (re-exec once), then the absl app."""
    common.tune_cpu_malloc()
    app.run(main, flags_parser=flag_errors.parse_flags)
