"""Supervised fine-tuning entry point: `pjit-ppo-sft` or `python launch/train_sft.py`.

  pjit-ppo-sft --config=configs/RECIPE.py --workdir=/tmp/sft
  pjit-ppo-sft --config=configs/RECIPE.py:ARG --workdir=DIR --config.lr=3e-4 \
      --config.model.policy_path=/models/gpt2 --config.data_path=corpus.jsonl

`--config` is a recipe file defining `get_config(arg="") -> SFTConfig`
(pjit_ppo/config/sft.py); `--config.a.b=v` overrides any field. Writes
WORKDIR/config.json, metrics.jsonl, tensorboard/, checkpoints/<step>/ and the trained
model as an HF directory in WORKDIR/model/ (with the tokenizer). A bad config, corpus
or tokenizer is one line on stderr and exit status 2.

Re-running the same command on the same WORKDIR resumes from the latest complete
checkpoint and ends as an uninterrupted run would (a config that changes what the
run computes is refused: one line, exit status 2). SIGTERM / SIGINT: the current step
finishes, a checkpoint is saved, exit status 0.
"""
from absl import app, flags, logging
from ml_collections import config_flags

from pjit_ppo.cli import common, flag_errors

_CONFIG = config_flags.DEFINE_config_file("config", None, "SFT config file (get_config).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config.json, metrics.jsonl, "
                                                "tensorboard/ and model/ are written there.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    common.no_extra_args(argv)
    config, workdir = _CONFIG.value, _WORKDIR.value
    from pjit_ppo import preflight
    with common.user_errors():  # ConfigError / DataError: one line, exit 2; nothing written
        preflight.check_sft(config, workdir)
    common.setup_jax()
    from pjit_ppo import sft
    with common.fresh_workdir_removed_if_refused(workdir):
        with common.user_errors():
            out = sft.train(config, workdir)
    if out.get("preempted"):
        return  # the loop logged where it stopped and saved; exit status 0
    logging.info("SFT done: held-out loss %.4f -> %.4f, model in %s",
                 out["test/loss_initial"], out["test/loss"], out["model_dir"])


def run_main():
    """The console script: CPU malloc tuning (re-exec once), then the absl app."""
    common.tune_cpu_malloc()
    app.run(main, flags_parser=flag_errors.parse_flags)
