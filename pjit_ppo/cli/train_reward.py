"""Reward learning entry point: `pjit-ppo-reward` or `python launch/train_reward.py`.

  pjit-ppo-reward --config=configs/RECIPE.py --workdir=/tmp/rm
  pjit-ppo-reward --config=configs/RECIPE.py --workdir=DIR \
      --config.labels_path=labels.jsonl --config.model.policy_path=/models/gpt2

`--config` is a recipe file defining `get_config(arg="") -> RewardLearningConfig`
(pjit_ppo/config/reward.py); `--config.a.b=v` overrides any field. Writes
WORKDIR/config.json, metrics.jsonl, tensorboard/, checkpoints/<step>/ and the reward
model in WORKDIR/reward_model/ (PPO: reward.kind="model",
reward.path=WORKDIR/reward_model). A bad config, a bad label record (named by file and
line) or a bad tokenizer is one line on stderr and exit status 2.

Re-running the same command on the same WORKDIR resumes from the latest complete
checkpoint and ends as an uninterrupted run would (a config that changes what the
run computes is refused: one line, exit status 2). SIGTERM / SIGINT: the current step
finishes, a checkpoint is saved, exit status 0.
"""
from absl import app, flags, logging
from ml_collections import config_flags

from pjit_ppo.cli import common, flag_errors

_CONFIG = config_flags.DEFINE_config_file("config", None, "Reward learning config file "
                                                          "(get_config).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config.json, metrics.jsonl, "
                                                "tensorboard/ and reward_model/ are written "
                                                "there.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    common.no_extra_args(argv)
    config, workdir = _CONFIG.value, _WORKDIR.value
    from pjit_ppo import preflight
    with common.user_errors():  # ConfigError / DataError: one line, exit 2; nothing written
        preflight.check_reward_learning(config, workdir)
    common.setup_jax()
    from pjit_ppo import reward as reward_learning
    with common.fresh_workdir_removed_if_refused(workdir):
        with common.user_errors():
            out = reward_learning.train(config, workdir)
    if out.get("preempted"):
        return  # the loop logged where it stopped and saved; exit status 0
    logging.info("reward learning done: held-out accuracy %.3f, reward model in %s",
                 out["test/accuracy"], out["reward_model_dir"])


def run_main():
    """The console script: CPU malloc tuning (re-exec once), then the absl app."""
    common.tune_cpu_malloc()
    app.run(main, flags_parser=flag_errors.parse_flags)
