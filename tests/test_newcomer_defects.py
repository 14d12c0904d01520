"""What a newcomer met with their own model (issue 27), each as they meet it: a real
entry-point subprocess, its message and exit status, and the files it leaves.

One tiny run of configs/hf_model.py on an HF directory of the newcomer's own (GPT-2
architecture, a word-level tokenizer, a generation_config.json, 24 held-out prompts), with
no override but the model and the prompts, is shared by the tests of this module; it is
the run test_hf_model_recipe's gpt2 case checks (tests/own_model_run.py: made once per
session).
"""
import json

import pytest

import own_model_run
import runs


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    run = own_model_run.own_run(tmp_path_factory, "gpt2", n_positions=128)
    assert run["proc"].returncode == 0, run["proc"].stderr[-3000:]
    return run


def test_export_is_self_contained_and_quiet(own_run, tmp_path):
    """The export loads with AutoTokenizer and carries the source's generation config;
    the command prints no library warnings about reading the checkpoint read-only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "export"
    proc = runs.run("export_hf.py", f"--workdir={own_run['workdir']}", f"--output={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    source = AutoTokenizer.from_pretrained(str(own_run["model"]))
    text = "the cat sees a ball ."
    assert tokenizer(text)["input_ids"] == source(text)["input_ids"]
    assert json.loads((out / "generation_config.json").read_text())["temperature"] == 0.6
    AutoModelForCausalLM.from_pretrained(str(out))
    noise = [line for line in proc.stderr.splitlines()
             if "WARNING" in line or line.startswith("W1") or "read-only" in line.lower()]
    assert not noise, noise


def test_evaluation_uses_the_held_out_set_once(own_run):
    """24 prompts (a multiple of the 8 batch devices of the test's launch): evaluated once
    each by default, not 256 times over; an explicit larger number says prompts repeat."""
    workdir = own_run["workdir"]
    proc = runs.run("evaluate.py", *own_run["args"], f"--workdir={workdir}", devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((workdir / "eval" / "20" / "eval.json").read_text())
    assert report["num_prompts"] == 24 and report["prompt_set_size"] == 24
    assert report["prompts_repeat"] is False
    rows = (workdir / "eval" / "20" / "samples.jsonl").read_text().splitlines()
    assert len(rows) == 24 and len({json.loads(r)["prompt"] for r in rows}) == 24
    proc = runs.run("evaluate.py", *own_run["args"], f"--workdir={workdir}",
                    "--config.evaluation.num_prompts=64", devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((workdir / "eval" / "20" / "eval.json").read_text())
    assert report["num_prompts"] == 64 and report["prompts_repeat"] is True
    assert "prompts repeat" in proc.stderr


def test_planner_checks_its_launch_like_training(own_run):
    """A recipe whose reward model is not there: one line naming the field and the path,
    exit 2 (it was a traceback and exit 1)."""
    proc = runs.run("plan.py", f"--config={runs.ROOT}/configs/gpt2_sentiment.py",
                    f"--config.model.policy_path={own_run['model']}", "--devices=1",
                    "--search=false", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "reward.path='models/gpt2_sentiment_reward'" in lines[0]
    assert "no such file or directory" in lines[0]
    proc = runs.run("plan.py", f"--config={runs.ROOT}/configs/gpt2_sentiment.py",
                    "--config.ppo.lrr=1", timeout=300)
    assert proc.returncode == 2 and "did you mean 'lr'" in proc.stderr, proc.stderr[-3000:]
