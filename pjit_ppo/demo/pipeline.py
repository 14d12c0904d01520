"""The embedded RLHF demo, end to end, offline: data -> SFT -> labels -> reward model ->
PPO -> evaluation -> report. `run(workdir)` is what `launch/demo.py` calls.

Each stage writes its own subdirectory (see pjit_ppo/demo/configs.py) and a
`DONE` marker when it finishes; running the demo again skips finished stages, and
PPO continues from its latest checkpoint, so an interrupted demo loses no work.

The report (in the work directory):
  samples.jsonl  one line per held-out prompt: prompt, response before / after PPO,
                 learned reward and gold (VADER) score of each
  plot.png       learned reward, KL and gold score over PPO iterations
  summary.json   reward_before, reward_after, gold_before, gold_after,
                 reward_model_accuracy, kl_final, wall_seconds (and more)
"""
from __future__ import annotations

import json
import os
import random
import time
from typing import Any, Callable, Dict, List

import numpy as np
from absl import logging

from pjit_ppo.demo import configs, procedural_text as corpus, labeller, sampler, tokenizer as demo_tokenizer

STAGES = ("data", "sft", "labels", "reward", "ppo", "evaluate")
LABEL_TEMPERATURE = 0.25  # the labeller's softmax temperature over VADER compound scores


def _done(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "DONE"))


def _mark_done(directory: str, info: Dict[str, Any]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "DONE"), "w") as f:
        json.dump(info, f, indent=2)


def _read_done(directory: str) -> Dict[str, Any]:
    with open(os.path.join(directory, "DONE")) as f:
        return json.load(f)


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


RUNNERS: Dict[str, Callable[[str, configs.Sizes], Dict[str, Any]]] = {
    "data": stage_data, "sft": stage_sft, "labels": stage_labels, "reward": stage_reward,
    "ppo": stage_ppo, "evaluate": stage_evaluate}


def _stage_dir(p, stage: str) -> str:
    return {"data": p["data"], "sft": p["sft"], "labels": p["labels_dir"],
            "reward": p["reward"], "ppo": p["ppo"],
            "evaluate": os.path.join(p["ppo"], "eval")}[stage]


def _jsonl(path: str) -> List[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def report(workdir: str, stage_info: Dict[str, Dict[str, Any]], wall_seconds: float
           ) -> Dict[str, Any]:
    """Writes samples.jsonl, plot.png and summary.json; returns the summary."""
    p = configs.paths(workdir)
    judge = labeller.GoldJudge()
    ev = stage_info["evaluate"]
    rows = _jsonl(os.path.join(p["ppo"], "eval", str(ev["checkpoint_step"]), "samples.jsonl"))
    gold_before = judge([r["reference_response"] for r in rows])
    gold_after = judge([r["policy_response"] for r in rows])
    with open(os.path.join(p["root"], "samples.jsonl"), "w", encoding="utf-8") as f:
        for r, gb, ga in zip(rows, gold_before, gold_after):
            f.write(json.dumps({"prompt": r["prompt"], "response_before": r["reference_response"],
                                "response_after": r["policy_response"],
                                "reward_before": r["reference_reward"],
                                "reward_after": r["policy_reward"], "gold_before": float(gb),
                                "gold_after": float(ga)}, ensure_ascii=False) + "\n")
    metrics = _jsonl(os.path.join(p["ppo"], "metrics.jsonl"))
    tables: Dict[int, List[str]] = {}
    for r in _jsonl(os.path.join(p["ppo"], "samples.jsonl")):
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
        "labeller": {"agrees_with_gold_best": stage_info["labels"]["train"][
            "agrees_with_gold_best"], "temperature": LABEL_TEMPERATURE},
        "sft_heldout_loss": stage_info["sft"].get("test/loss"),
        "stage_seconds": {s: stage_info[s].get("_seconds") for s in STAGES},
        "wall_seconds": wall_seconds,
    }
    with open(os.path.join(p["root"], "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
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


def run(workdir: str, quick: bool = False) -> Dict[str, Any]:
    """Runs (or finishes) every stage of the demo in `workdir`; returns summary.json's dict,
    or {"preempted": True, "stage": name} when a signal stopped a stage (it saved a
    checkpoint; the same call finishes the demo)."""
    t0 = time.time()
    sizes = configs.QUICK if quick else configs.FULL
    arg = workdir + (",quick" if quick else "")
    p = configs.paths(workdir)
    info: Dict[str, Dict[str, Any]] = {}
    for number, stage in enumerate(STAGES, 1):
        directory = _stage_dir(p, stage)
        if _done(directory):
            info[stage] = _read_done(directory)
            logging.info("demo stage %d/%d %s: already done", number, len(STAGES), stage)
            continue
        logging.info("demo stage %d/%d %s ...", number, len(STAGES), stage)
        start = time.time()
        result = dict(RUNNERS[stage](arg, sizes))
        if result.get("preempted"):  # a signal: the stage saved a checkpoint and returned
            logging.warning("demo stopped in stage %s by a signal; run the same command to "
                            "finish it", stage)
            return {"preempted": True, "stage": stage}
        result["_seconds"] = time.time() - start
        _mark_done(directory, _json_ready(result))
        info[stage] = _read_done(directory)
        logging.info("demo stage %s done in %.0f s", stage, result["_seconds"])
    summary = report(workdir, info, time.time() - t0)
    logging.info("demo summary: %s", json.dumps(summary))
    return summary


def _json_ready(tree):
    return json.loads(json.dumps(tree, default=lambda x: float(x) if np.ndim(x) == 0 else str(x)))
