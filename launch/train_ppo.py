"""PPO training entrypoint.

  python launch/train_ppo.py --config=configs/tiny_demo.py --workdir=/tmp/demo
  python launch/train_ppo.py --config=configs/gpt2_sentiment.py --config.ppo.lr=2e-5 ...
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pjit_ppo import host_malloc  # noqa: E402

if __name__ == "__main__":  # before jax starts: see pjit_ppo/host_malloc.py
    host_malloc.reexec_with_tuned_malloc()

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pjit_ppo.ppo import run  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_demo.py",
                                          "Run config file (get_config).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/pjit_ppo_demo",
                               "Directory for metrics.jsonl, TensorBoard and checkpoints.")


def main(argv):
    del argv
    last = run.train(_CONFIG.value, _WORKDIR.value)
    logging.info("final metrics: %s", {k: round(v, 4) for k, v in sorted(last.items())})


if __name__ == "__main__":
    app.run(main)
