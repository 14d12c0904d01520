"""The embedded demo: its pieces (corpus, tokenizer, labeller) and shortened end-to-end
runs through the entry point (slow), as README command one runs it at full size: PPO (the
default) and DPO (--algo=dpo) on the same labels."""
import json
import math
import os
import shutil
import subprocess

import numpy as np
import pytest

from pjit_ppo.demo import procedural_text as corpus, labeller, tokenizer as demo_tokenizer

from tests import runs


def test_corpus_is_deterministic_split_and_carries_vader_sentiment(tmp_path):
    options = corpus.CorpusOptions(num_sentences=600, num_heldout=60, seed=3)
    a, b = corpus.generate(options), corpus.generate(options)
    assert a == b and len(a["heldout"]) == 60 and 0 < len(a["train"]) <= 600
    train = {p + c for p, c in a["train"]}
    assert not train & {p + c for p, c in a["heldout"]}
    assert all(c.endswith(" .") and c.startswith(" ") for _, c in a["train"])
    judge = labeller.GoldJudge()
    def words(kind):
        return [w for table in (corpus.ADJECTIVES, corpus.VERBS, corpus.ADVERBS)
                for w in table[kind]]
    for kind, sign in (("positive", 1), ("negative", -1), ("neutral", 0)):
        assert (np.sign(judge(words(kind))) == sign).all(), kind
    assert (judge(list(corpus.NOUNS) + list(corpus.DETERMINERS) + ["and", "."]) == 0).all()


def test_tokenizer_loads_with_autotokenizer_and_round_trips(tmp_path):
    from transformers import AutoTokenizer
    lines = [p + c for p, c in corpus.generate(corpus.CorpusOptions(num_sentences=500))["train"]]
    n = demo_tokenizer.train_tokenizer(lines, str(tmp_path), vocab_size=768)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == n and tok.pad_token == "<pad>" and tok.pad_token_id == 1
    assert tok.decode(tok(lines[0], add_special_tokens=False)["input_ids"]) == lines[0]
    assert len(tok(" .", add_special_tokens=False)["input_ids"]) == 1


def test_noisy_choices_prefer_the_best_and_sometimes_err():
    gold = np.tile([[-0.5, 0.0, 0.3, 0.9]], (4000, 1))
    choices = labeller.noisy_choices(gold, 0.25, seed=0)
    freq = np.bincount(choices, minlength=4) / len(choices)
    expect = np.exp(gold[0] / 0.25) / np.exp(gold[0] / 0.25).sum()
    np.testing.assert_allclose(freq, expect, atol=0.03)
    assert (labeller.noisy_choices(gold[:10], 1e-9, seed=1) == 3).all()


@pytest.fixture(scope="module")
def quick_ppo_demo(tmp_path_factory):
    """(work directory, CompletedProcess) of `demo.py --quick`, run once per module."""
    workdir = str(tmp_path_factory.mktemp("ppo_demo") / "demo")
    result = subprocess.run(runs.command("demo.py", f"--workdir={workdir}", "--quick"),
                            cwd=runs.ROOT, env=runs.env(), capture_output=True, text=True,
                            timeout=1500)
    return workdir, result


@pytest.mark.slow
def test_shortened_demo_writes_every_output(quick_ppo_demo):
    workdir, result = quick_ppo_demo
    assert result.returncode == 0, result.stderr[-4000:]
    for name in ("samples.jsonl", "plot.png", "summary.json", "data/tokenizer/tokenizer.json",
                 "sft/model/config.json", "sft/metrics.jsonl", "labels/labels.jsonl",
                 "reward/reward_model/config.json", "reward/metrics.jsonl",
                 "ppo/metrics.jsonl", "ppo/samples.jsonl"):
        assert os.path.exists(os.path.join(workdir, name)), name
    for stage in ("sft", "reward", "ppo"):
        assert os.listdir(os.path.join(workdir, stage, "tensorboard")), stage
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    for key in ("reward_before", "reward_after", "gold_before", "gold_after",
                "reward_model_accuracy", "kl_final", "wall_seconds"):
        assert isinstance(summary[key], float) and math.isfinite(summary[key]), key
    rows = [json.loads(line) for line in open(os.path.join(workdir, "samples.jsonl"))]
    assert len(rows) == summary["eval_prompts"]
    assert all(isinstance(r["response_before"], str) and isinstance(r["response_after"], str)
               for r in rows)
    np.testing.assert_allclose(np.mean([r["gold_after"] for r in rows]), summary["gold_after"])
    assert open(os.path.join(workdir, "plot.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # Running it again finds every stage done and reports the same figures.
    again = subprocess.run(runs.command("demo.py", f"--workdir={workdir}", "--quick"),
                           cwd=runs.ROOT, env=runs.env(), capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "already done" in again.stderr
    summary2 = json.load(open(os.path.join(workdir, "summary.json")))
    assert {k: v for k, v in summary2.items() if k != "wall_seconds"} == {
        k: v for k, v in summary.items() if k != "wall_seconds"}


@pytest.mark.slow
def test_shortened_demo_with_dpo_raises_the_gold_score(quick_ppo_demo, tmp_path):
    """--algo=dpo: the same data, SFT policy and labels, then DPO instead of the reward
    model and PPO; the DPO policy's samples of held-out prompts score higher with the gold
    judge than the SFT policy's (same prompts, same random draws). The stages both
    algorithms share are the PPO demo's, copied: this run finds them done, as a user's
    second `--algo=dpo` in the same work directory would."""
    workdir = str(tmp_path / "demo")
    ppo_workdir, ppo_result = quick_ppo_demo
    assert ppo_result.returncode == 0, ppo_result.stderr[-4000:]
    for stage in ("data", "sft", "labels"):
        shutil.copytree(os.path.join(ppo_workdir, stage), os.path.join(workdir, stage))
    args = (f"--workdir={workdir}", "--quick", "--algo=dpo")
    result = subprocess.run(runs.command("demo.py", *args), cwd=runs.ROOT, env=runs.env(),
                            capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count("already done") == 3  # data, sft, labels
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(printed) == {"dpo_gold_before", "dpo_gold_after", "dpo_reward_accuracy",
                            "wall_seconds"}
    for name in ("dpo_samples.jsonl", "dpo_plot.png", "summary.json", "sft/model/config.json",
                 "labels/labels.jsonl", "dpo/model/config.json", "dpo/model/tokenizer.json",
                 "dpo/reference_logps.npz", "dpo/metrics.jsonl", "dpo/eval/samples.jsonl"):
        assert os.path.exists(os.path.join(workdir, name)), name
    for name in ("reward", "ppo", "samples.jsonl", "plot.png"):  # no PPO stage ran
        assert not os.path.exists(os.path.join(workdir, name)), name
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    assert not {"gold_before", "gold_after", "reward_model_accuracy"} & set(summary)
    assert list(summary["stage_seconds"]) == ["data", "sft", "labels", "dpo", "dpo_evaluate"]
    rows = [json.loads(line) for line in open(os.path.join(workdir, "dpo_samples.jsonl"))]
    assert len(rows) == summary["dpo_eval_samples"] == 64 * 4
    np.testing.assert_allclose(np.mean([r["gold_before"] for r in rows]),
                               summary["dpo_gold_before"])
    np.testing.assert_allclose(np.mean([r["gold_after"] for r in rows]),
                               summary["dpo_gold_after"])
    # Measured: -0.056 -> 0.161 (48 DPO steps on 768 pairs).
    assert summary["dpo_gold_after"] > summary["dpo_gold_before"] + 0.05, summary
    assert summary["dpo_reward_margin"] > 0  # held-out pairs: chosen above rejected
    assert open(os.path.join(workdir, "dpo_plot.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # Running it again finds every stage done and reports the same figures.
    again = subprocess.run(runs.command("demo.py", *args), cwd=runs.ROOT, env=runs.env(),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "already done" in again.stderr
    summary2 = json.load(open(os.path.join(workdir, "summary.json")))
    assert {k: v for k, v in summary2.items() if k != "wall_seconds"} == {
        k: v for k, v in summary.items() if k != "wall_seconds"}
