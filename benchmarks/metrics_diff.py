"""How far two runs' metrics.jsonl are apart, iteration by iteration.

  python benchmarks/metrics_diff.py A/metrics.jsonl B/metrics.jsonl [--keys objective/,ppo/]

For a change that should only move float32 rounding (e.g. a different matmul
layout), run the same config and inputs before and after and compare: per iteration,
how many of the selected metrics are bit-equal, the largest relative difference
among the rest, and the largest among the rollout's `objective/*` metrics (equal up
to rounding while both runs sample the same responses). Two runs that differ in the last bits of
the weights sample the same tokens until one draw lands on the other side of a
threshold; from then on they are two different runs, and only their statistics
compare. The mean of whitened advantages (`ppo/val/advantage`, zero up to rounding)
and the clip fractions (counts of a strict comparison) are listed apart, since their
relative differences are not meaningful.
"""
import argparse
import json
import math

NOISY = ("ppo/val/advantage", "ppo/val/clipfrac_avg", "ppo/policy/clipfrac_avg")


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def relative(a, b) -> float:
    if a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--keys", default="objective/,ppo/",
                   help="comma-separated prefixes of the metrics compared")
    p.add_argument("--rollout_rtol", type=float, default=1e-4,
                   help="an objective/* difference above this means different samples")
    args = p.parse_args()
    prefixes = tuple(args.keys.split(","))
    runs = load(args.a), load(args.b)
    first_diverged = None
    for x, y in zip(*runs):
        keys = sorted(k for k in x if k.startswith(prefixes) and isinstance(x[k], (int, float))
                      and k in y and not isinstance(x[k], bool))
        diffs = {k: relative(x[k], y[k]) for k in keys}
        equal = sum(1 for k in keys if diffs[k] == 0.0)
        kept = {k: d for k, d in diffs.items() if k not in NOISY}
        worst = max(kept, key=kept.get) if kept else None
        rollout = max((d for k, d in kept.items() if k.startswith("objective/")), default=0.0)
        if rollout > args.rollout_rtol and first_diverged is None:
            first_diverged = x["iteration"]
        print(f"iteration {x['iteration']}: {equal}/{len(keys)} bit-equal; worst "
              f"{kept.get(worst, 0.0):.1e} ({worst}); worst objective/* {rollout:.1e}")
    print(f"iterations compared: {min(map(len, runs))}; first whose objective/* differ by "
          f"more than {args.rollout_rtol:g}: {first_diverged}")


if __name__ == "__main__":
    main()
