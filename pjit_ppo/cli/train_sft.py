"""Supervised fine-tuning entry point: `pjit-ppo-sft` or `python launch/train_sft.py`.

  pjit-ppo-sft --config=configs/RECIPE.py --workdir=/tmp/sft
  pjit-ppo-sft --config=configs/RECIPE.py:ARG --workdir=DIR --config.lr=3e-4 \
      --config.model.policy_path=/models/gpt2 --config.data_path=corpus.jsonl

`--config` is a recipe file defining `get_config(arg="") -> SFTConfig`
(pjit_ppo/stage_config.py); `--config.a.b=v` overrides any field. Writes
WORKDIR/config.json, metrics.jsonl, tensorboard/ and the trained model as an HF
directory in WORKDIR/model/ (with the tokenizer). A bad config, corpus or tokenizer
is one line on stderr and exit status 2.
"""
from absl import app, flags, logging
from ml_collections import config_flags

from pjit_ppo.cli import common, flag_errors, stage_checks

_CONFIG = config_flags.DEFINE_config_file("config", None, "SFT config file (get_config).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config.json, metrics.jsonl, "
                                                "tensorboard/ and model/ are written there.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    common.no_extra_args(argv)
    config, workdir = _CONFIG.value, _WORKDIR.value
    with common.config_errors(), stage_checks.data_errors():  # nothing written yet
        stage_checks.check_sft(config)
    common.setup_jax()
    from pjit_ppo import sft
    with common.user_errors():
        out = sft.train(config, workdir)
    logging.info("SFT done: held-out loss %.4f -> %.4f, model in %s",
                 out["test/loss_initial"], out["test/loss"], out["model_dir"])


def run_main():
    """The console script: CPU malloc tuning (re-exec once), then the absl app."""
    common.tune_cpu_malloc()
    app.run(main, flags_parser=flag_errors.parse_flags)
