"""The embedded RLHF demo, every stage in one command: `pjit-ppo-demo` or
`python launch/demo.py`.

  pjit-ppo-demo --workdir=/tmp/pjit_ppo_demo
  pjit-ppo-demo --workdir=/tmp/pjit_ppo_demo --algo=dpo    # DPO instead of reward model + PPO
  pjit-ppo-demo --workdir=/tmp/pjit_ppo_demo --algo=all    # both, compared in summary.json

Offline, on a CPU, in a few minutes: writes a procedural English-like corpus and a
BPE tokenizer, pretrains a small GPT-J-architecture policy on it (SFT), labels
best-of-4 samples with a noisy sentiment labeller (VADER as the gold judge), trains a
reward model on the labels, runs PPO against it, and evaluates the result against
the SFT policy. Writes each stage's outputs under WORKDIR (pjit_ppo/demo/configs.py)
and WORKDIR/samples.jsonl, plot.png, summary.json. --algo=dpo trains the SFT policy
with DPO on the same labels instead of the reward model and PPO, and scores it with
the same gold judge on held-out prompts (WORKDIR/dpo_samples.jsonl, dpo_plot.png,
summary.json's dpo_* keys); --algo=all runs both. Running it again finishes an
interrupted demo. Each stage is also its own entry point with configs/demo_*.py.
"""
import json
import sys

from absl import app, flags

from pjit_ppo.cli import common, flag_errors

_WORKDIR = flags.DEFINE_string("workdir", None, "Where every stage writes its outputs.")
_QUICK = flags.DEFINE_bool("quick", False, "A shortened run (fewer sentences, labels and "
                                           "PPO iterations) for tests.")
_ALGO = flags.DEFINE_enum("algo", "ppo", ["ppo", "dpo", "all"],
                         "ppo: reward model + PPO; dpo: DPO on the same labels; all: both.")
flags.mark_flags_as_required(["workdir"])

#: The summary keys printed on stdout, by what ran.
PPO_KEYS = ("reward_before", "reward_after", "gold_before", "gold_after",
            "reward_model_accuracy", "kl_final")
DPO_KEYS = ("dpo_gold_before", "dpo_gold_after", "dpo_reward_accuracy")


def main(argv):
    common.no_extra_args(argv)
    common.setup_jax()
    from pjit_ppo.demo import pipeline
    with common.user_errors():
        summary = pipeline.run(_WORKDIR.value, quick=_QUICK.value, algo=_ALGO.value)
    if summary.get("preempted"):
        return  # the stage saved a checkpoint and said so; exit status 0
    keys = {"ppo": PPO_KEYS, "dpo": DPO_KEYS, "all": PPO_KEYS + DPO_KEYS}[_ALGO.value] + (
        "wall_seconds",)
    print(json.dumps({k: summary[k] for k in keys}), file=sys.stdout)


def run_main():
    common.tune_cpu_malloc()
    app.run(main, flags_parser=flag_errors.parse_flags)
