"""PPO training entry point: `pjit-ppo-train` or `python launch/train_ppo.py`.

  pjit-ppo-train --config=configs/tiny_demo.py --workdir=/tmp/demo
  pjit-ppo-train --config=configs/tiny_demo.py --workdir=DIR --config.ppo.lr=1e-3

`--config` is a recipe file defining `get_config(arg="") -> RunConfig`
(`--config=FILE:ARG` passes ARG); `--config.a.b=v` overrides any field.
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from pjit_ppo.cli import cpu_malloc

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (get_config).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config.json, metrics.jsonl "
                                                "and tensorboard/ are written there.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import jax  # after the malloc re-exec and flag parsing
    from pjit_ppo.config import ConfigError
    from pjit_ppo.ppo import run
    from pjit_ppo.ppo.trainer import NonFiniteError

    jax.config.config_with_absl()
    try:
        last = run.train(_CONFIG.value, _WORKDIR.value)
    except ConfigError as e:
        print(f"error: invalid config: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteError as e:
        print(f"error: training stopped: {e}", file=sys.stderr)
        sys.exit(1)
    logging.info("final metrics: %s", {k: round(v, 4) for k, v in sorted(last.items())})


def run_main():
    """The console script: CPU malloc tuning (re-exec once), then the absl app."""
    cpu_malloc.reexec_with_tuned_malloc()
    app.run(main)
