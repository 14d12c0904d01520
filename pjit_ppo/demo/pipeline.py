"""The embedded RLHF demo, end to end, offline: data -> SFT -> labels -> reward model ->
PPO -> evaluation -> report. `run(workdir)` is what `launch/demo.py` calls;
`run(workdir, algo="dpo")` trains the SFT policy with DPO on the same labels instead
(data -> SFT -> labels -> DPO -> gold evaluation), and algo="all" runs both.

Each stage writes its own subdirectory (see pjit_ppo/demo/configs.py) and a
`DONE` marker when it finishes; running the demo again skips finished stages, and
PPO continues from its latest checkpoint, so an interrupted demo loses no work.

The report (in the work directory):
  samples.jsonl  one line per held-out prompt: prompt, response before / after PPO,
                 learned reward and gold (VADER) score of each
  plot.png       learned reward, KL and gold score over PPO iterations
  summary.json   reward_before, reward_after, gold_before, gold_after,
                 reward_model_accuracy, kl_final, wall_seconds (and more)
With DPO (algo "dpo" or "all"), also:
  dpo_samples.jsonl  one line per held-out prompt and sample: prompt, response of the SFT
                     policy (before) and of the DPO policy (after), gold score of each
  dpo_plot.png       DPO's loss, reward accuracy and reward margin (train and held out)
  summary.json       dpo_gold_before, dpo_gold_after (VADER gold of the SFT and the DPO
                     policy's samples of the same held-out prompts, the same random
                     draws), dpo_reward_accuracy, dpo_reward_margin, dpo_steps, dpo_pairs,
                     dpo_eval_samples; algo "dpo" writes no PPO keys
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from typing import Any, Callable, Dict, List

import numpy as np
from absl import logging

from pjit_ppo.demo import configs, procedural_text as corpus, labeller, sampler, stages, tokenizer as demo_tokenizer

STAGES = ("data", "sft", "labels", "reward", "ppo", "evaluate")
DPO_STAGES = ("dpo", "dpo_evaluate")
#: --algo -> the stages it runs, in order (the default "ppo" is STAGES).
ALGO_STAGES = {"ppo": STAGES, "dpo": STAGES[:3] + DPO_STAGES, "all": STAGES + DPO_STAGES}
LABEL_TEMPERATURE = 0.25  # the labeller's softmax temperature over VADER compound scores
DPO_EVAL_SAMPLES = 4      # samples per held-out prompt in DPO's gold evaluation
DPO_EVAL_SEED = 21        # their random draws (the same for the SFT and the DPO policy)


def _load_tokenizer(p):
    from pjit_ppo.data.prompts import load_tokenizer
    return load_tokenizer(p["tokenizer"])


def stage_data(arg: str, sizes: configs.Sizes) -> Dict[str, Any]:
    """The corpus, its prompts and a BPE tokenizer trained on it; the stop token id."""
    p = configs.paths(arg.partition(",")[0])
    files = corpus.write(p["data"], corpus.CorpusOptions(num_sentences=sizes.sentences,
                                                         num_heldout=sizes.heldout))
    with open(files["corpus_train"], encoding="utf-8") as f:
        n = demo_tokenizer.train_tokenizer(f, p["tokenizer"], vocab_size=768)
    tok = _load_tokenizer(p)
    stop = tok(" .", add_special_tokens=False)["input_ids"]
    if len(stop) != 1 or n > configs.MODEL["vocab_size"] or tok.pad_token_id != configs.PAD_ID:
        raise RuntimeError(f"demo tokenizer does not fit the demo model: {n} tokens, "
                           f"' .' -> {stop}, pad {tok.pad_token_id}")
    with open(p["stop_token"], "w") as f:
        f.write(str(stop[0]))
    return {"tokens": n, "stop_token": stop[0], "sentences": sizes.sentences}


def stage_sft(arg: str, sizes: configs.Sizes) -> Dict[str, Any]:
    from pjit_ppo import sft
    return sft.train(configs.sft(arg), configs.paths(arg.partition(",")[0])["sft"])


def _prompts(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f]


def _write_labels(path: str, prompts: List[str], p, seed: int, judge) -> Dict[str, float]:
    tok = _load_tokenizer(p)
    stop = configs.stop_token_id(p["root"])
    responses = sampler.continuations(
        p["policy"], tok, prompts, samples=4, query_length=configs.QUERY_LENGTH,
        response_length=configs.RESPONSE_LENGTH, temperature=configs.TEMPERATURE,
        pad_id=configs.PAD_ID, stop_token=stop, truncate_after=2, seed=seed)
    gold = np.array([judge(rs) for rs in responses])  # [M, 4]
    choices = labeller.noisy_choices(gold, LABEL_TEMPERATURE, seed)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for record in labeller.best_of_n_records(prompts, responses, choices):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)
    best = gold.argmax(axis=1)
    return {"labels": len(prompts), "agrees_with_gold_best": float(np.mean(choices == best)),
            "gold_of_chosen": float(gold[np.arange(len(gold)), choices].mean()),
            "gold_mean": float(gold.mean())}


def stage_labels(arg: str, sizes: configs.Sizes) -> Dict[str, Any]:
    """Best-of-4 continuations of corpus prompts by the SFT policy, chosen by the noisy
    VADER labeller: training labels from training prompts, test labels from held-out ones."""
    p = configs.paths(arg.partition(",")[0])
    os.makedirs(p["labels_dir"], exist_ok=True)
    judge = labeller.GoldJudge()
    train = random.Random(0).sample(_prompts(p["prompts_train"]), sizes.labels)
    test = _prompts(p["prompts_heldout"])[:sizes.test_labels]
    return {"train": _write_labels(p["labels"], train, p, 10, judge),
            "test": _write_labels(p["labels_test"], test, p, 11, judge)}


def stage_reward(arg: str, sizes: configs.Sizes) -> Dict[str, Any]:
    from pjit_ppo import reward as reward_learning
    return reward_learning.train(configs.reward(arg), configs.paths(arg.partition(",")[0])[
        "reward"])


def stage_ppo(arg: str, sizes: configs.Sizes) -> Dict[str, Any]:
    from pjit_ppo.ppo.run import train
    return train(configs.ppo(arg), configs.paths(arg.partition(",")[0])["ppo"])


def stage_evaluate(arg: str, sizes: configs.Sizes) -> Dict[str, Any]:
    from pjit_ppo.evaluation import evaluate
    return evaluate(configs.ppo(arg), configs.paths(arg.partition(",")[0])["ppo"])


def stage_dpo(arg: str, sizes: configs.Sizes) -> Dict[str, Any]:
    from pjit_ppo import dpo
    return dpo.train(configs.dpo(arg), configs.paths(arg.partition(",")[0])["dpo"])


def stage_dpo_evaluate(arg: str, sizes: configs.Sizes) -> Dict[str, Any]:
    """VADER gold of the SFT policy and of the DPO policy on the first eval_prompts
    held-out prompts, DPO_EVAL_SAMPLES continuations each, drawn with the same random
    numbers for both (sampled and cut as the labels were); writes
    DIR/dpo/eval/samples.jsonl."""
    p = configs.paths(arg.partition(",")[0])
    prompts = _prompts(p["prompts_heldout"])[:sizes.eval_prompts]
    tok = _load_tokenizer(p)
    judge = labeller.GoldJudge()
    shape = dict(samples=DPO_EVAL_SAMPLES, query_length=configs.QUERY_LENGTH,
                 response_length=configs.RESPONSE_LENGTH, temperature=configs.TEMPERATURE,
                 pad_id=configs.PAD_ID, stop_token=configs.stop_token_id(p["root"]),
                 truncate_after=2, seed=DPO_EVAL_SEED)
    before = sampler.continuations(p["policy"], tok, prompts, **shape)
    after = sampler.continuations(p["dpo_model"], tok, prompts, **shape)
    gold_before = judge([t for ts in before for t in ts])
    gold_after = judge([t for ts in after for t in ts])
    os.makedirs(p["dpo_eval"], exist_ok=True)
    path = os.path.join(p["dpo_eval"], "samples.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        k = 0
        for prompt, bs, as_ in zip(prompts, before, after):
            for b, a in zip(bs, as_):
                f.write(json.dumps({"prompt": prompt, "response_before": b, "response_after": a,
                                    "gold_before": float(gold_before[k]),
                                    "gold_after": float(gold_after[k])},
                                   ensure_ascii=False) + "\n")
                k += 1
    os.replace(path + ".tmp", path)
    return {"gold_before": float(gold_before.mean()), "gold_after": float(gold_after.mean()),
            "eval_prompts": len(prompts), "samples_per_prompt": DPO_EVAL_SAMPLES,
            "win_rate_vs_sft": float(np.mean((gold_after > gold_before)
                                             + 0.5 * (gold_after == gold_before)))}


RUNNERS: Dict[str, Callable[[str, configs.Sizes], Dict[str, Any]]] = {
    "data": stage_data, "sft": stage_sft, "labels": stage_labels, "reward": stage_reward,
    "ppo": stage_ppo, "evaluate": stage_evaluate, "dpo": stage_dpo,
    "dpo_evaluate": stage_dpo_evaluate}


def _stage_dir(p, stage: str) -> str:
    return {"data": p["data"], "sft": p["sft"], "labels": p["labels_dir"],
            "reward": p["reward"], "ppo": p["ppo"],
            "evaluate": os.path.join(p["ppo"], "eval"), "dpo": p["dpo"],
            "dpo_evaluate": p["dpo_eval"]}[stage]


def report(workdir: str, stage_info: Dict[str, Dict[str, Any]], wall_seconds: float,
           algo: str = "ppo") -> Dict[str, Any]:
    """Writes summary.json and, for the algorithms that ran, PPO's samples.jsonl and
    plot.png and DPO's dpo_samples.jsonl and dpo_plot.png; returns the summary."""
    p = configs.paths(workdir)
    summary: Dict[str, Any] = {}
    if "evaluate" in stage_info:
        summary.update(_ppo_report(p, stage_info))
    if "dpo_evaluate" in stage_info:
        summary.update(_dpo_report(p, stage_info, with_common="evaluate" not in stage_info))
    summary["stage_seconds"] = {s: stage_info[s].get("_seconds") for s in ALGO_STAGES[algo]}
    summary["wall_seconds"] = wall_seconds
    with open(os.path.join(p["root"], "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _common_report(stage_info: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    return {"labeller": {"agrees_with_gold_best": stage_info["labels"]["train"][
                "agrees_with_gold_best"], "temperature": LABEL_TEMPERATURE},
            "sft_heldout_loss": stage_info["sft"].get("test/loss")}


def _dpo_report(p, stage_info: Dict[str, Dict[str, Any]], with_common: bool
                ) -> Dict[str, Any]:
    """DPO's summary keys; writes dpo_samples.jsonl and dpo_plot.png."""
    ev, run = stage_info["dpo_evaluate"], stage_info["dpo"]
    shutil.copyfile(os.path.join(p["dpo_eval"], "samples.jsonl"),
                    os.path.join(p["root"], "dpo_samples.jsonl"))
    _dpo_plot(os.path.join(p["root"], "dpo_plot.png"),
              stages.read_jsonl(os.path.join(p["dpo"], "metrics.jsonl")))
    out = {"dpo_gold_before": ev["gold_before"], "dpo_gold_after": ev["gold_after"],
           "dpo_win_rate_vs_sft": ev["win_rate_vs_sft"],
           "dpo_reward_accuracy": run["test/rewards/accuracies"],
           "dpo_reward_margin": run["test/rewards/margins"],
           "dpo_heldout_loss": run["test/loss"], "dpo_steps": run["steps"],
           "dpo_pairs": run["pairs"],
           "dpo_eval_samples": ev["eval_prompts"] * ev["samples_per_prompt"]}
    if with_common:
        out.update(_common_report(stage_info))
    return out


def _dpo_plot(path: str, metrics: List[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, name in zip(axes, ("loss", "rewards/accuracies", "rewards/margins")):
        for split, style in (("train", "-"), ("test", "o-")):
            points = [(m["iteration"], m[f"{split}/{name}"]) for m in metrics
                      if f"{split}/{name}" in m]
            ax.plot([i for i, _ in points], [v for _, v in points], style, label=split)
        ax.set_title(f"DPO {name}")
        ax.set_xlabel("DPO step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ppo_report(p, stage_info: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """PPO's summary keys; writes samples.jsonl and plot.png."""
    judge = labeller.GoldJudge()
    ev = stage_info["evaluate"]
    rows = stages.read_jsonl(os.path.join(p["ppo"], "eval", str(ev["checkpoint_step"]), "samples.jsonl"))
    gold_before = judge([r["reference_response"] for r in rows])
    gold_after = judge([r["policy_response"] for r in rows])
    with open(os.path.join(p["root"], "samples.jsonl"), "w", encoding="utf-8") as f:
        for r, gb, ga in zip(rows, gold_before, gold_after):
            f.write(json.dumps({"prompt": r["prompt"], "response_before": r["reference_response"],
                                "response_after": r["policy_response"],
                                "reward_before": r["reference_reward"],
                                "reward_after": r["policy_reward"], "gold_before": float(gb),
                                "gold_after": float(ga)}, ensure_ascii=False) + "\n")
    metrics = stages.read_jsonl(os.path.join(p["ppo"], "metrics.jsonl"))
    tables: Dict[int, List[str]] = {}
    for r in stages.read_jsonl(os.path.join(p["ppo"], "samples.jsonl")):
        tables.setdefault(r["iteration"], []).append(r["response"])
    gold_curve = {it: float(np.mean(judge(texts))) for it, texts in sorted(tables.items())}
    _plot(os.path.join(p["root"], "plot.png"), metrics, gold_curve)
    reward_info = stage_info["reward"]
    summary = {
        "reward_before": ev["reference_reward_mean"], "reward_after": ev["reward_mean"],
        "gold_before": float(gold_before.mean()), "gold_after": float(gold_after.mean()),
        "reward_model_accuracy": reward_info.get("test/accuracy"),
        "reward_model_accuracy_before_training": reward_info.get("test/accuracy_initial"),
        "kl_final": metrics[-1]["objective/kl"], "eval_kl": ev["kl_mean"],
        "win_rate_vs_reference": ev["win_rate_vs_reference"],
        "ppo_iterations": metrics[-1]["iteration"], "eval_prompts": ev["num_prompts"],
        **_common_report(stage_info),
    }
    return summary


def _plot(path: str, metrics: List[dict], gold_curve: Dict[int, float]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    it = [m["iteration"] for m in metrics]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(it, [m["objective/scores"] for m in metrics])
    axes[0].set_title("learned reward (objective/scores)")
    axes[1].plot(it, [m["objective/kl"] for m in metrics], color="tab:orange")
    axes[1].set_title("KL to the reference (objective/kl)")
    axes[2].plot(list(gold_curve), list(gold_curve.values()), "o-", color="tab:green")
    axes[2].set_title("gold: VADER compound of samples")
    for ax in axes:
        ax.set_xlabel("PPO iteration")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(workdir: str, quick: bool = False, algo: str = "ppo") -> Dict[str, Any]:
    """Runs (or finishes) every stage of the demo in `workdir` for `algo` ("ppo", "dpo" or
    "all": ALGO_STAGES); returns summary.json's dict, or {"preempted": True, "stage":
    name} when a signal stopped a stage (it saved a checkpoint; the same call finishes
    the demo)."""
    if algo not in ALGO_STAGES:
        raise ValueError(f"algo={algo!r}; choose one of {', '.join(ALGO_STAGES)}")
    t0 = time.time()
    sizes = configs.QUICK if quick else configs.FULL
    arg = workdir + (",quick" if quick else "")
    p = configs.paths(workdir)
    info, preempted = stages.run_stages(ALGO_STAGES[algo],
                                        lambda stage: RUNNERS[stage](arg, sizes),
                                        lambda stage: _stage_dir(p, stage))
    if preempted:
        return {"preempted": True, "stage": preempted}
    summary = report(workdir, info, time.time() - t0, algo)
    logging.info("demo summary: %s", json.dumps(summary))
    return summary

