"""What a newcomer met with their own model (issue 27), each as they meet it: a real
entry-point subprocess, its message and exit status, and the files it leaves.

One tiny run of configs/hf_model.py on an HF directory of the newcomer's own (GPT-2
architecture, a word-level tokenizer, a generation_config.json, 24 held-out prompts)
is shared by the tests of this module.
"""
import json
import os

import pytest

import runs
import tiny_hf
import tiny_text

RECIPE = os.path.join(runs.ROOT, "configs", "hf_model.py")


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("newcomer")
    model = root / "my_model"
    tiny_hf.save_model("gpt2", str(model), n_positions=128)
    tiny_text.save_tokenizer(str(model))
    (model / "generation_config.json").write_text(json.dumps({"do_sample": True,
                                                              "temperature": 0.6}))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": s}) + "\n"
                               for s in tiny_text.sentences(24, seed=5)))
    workdir = root / "run"
    args = (f"--config={RECIPE}", f"--config.model.policy_path={model}",
            f"--config.data.prompts_path={prompts}")
    proc = runs.run("train_ppo.py", *args, f"--workdir={workdir}",
                    "--config.num_iterations=2", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(root=root, model=model, prompts=prompts, workdir=workdir, args=args)


def test_export_is_self_contained_and_quiet(own_run):
    """The export loads with AutoTokenizer and carries the source's generation config;
    the command prints no library warnings about reading the checkpoint read-only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = own_run["root"] / "export"
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
    report = json.loads((workdir / "eval" / "2" / "eval.json").read_text())
    assert report["num_prompts"] == 24 and report["prompt_set_size"] == 24
    assert report["prompts_repeat"] is False
    rows = (workdir / "eval" / "2" / "samples.jsonl").read_text().splitlines()
    assert len(rows) == 24 and len({json.loads(r)["prompt"] for r in rows}) == 24
    proc = runs.run("evaluate.py", *own_run["args"], f"--workdir={workdir}",
                    "--config.evaluation.num_prompts=64", devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((workdir / "eval" / "2" / "eval.json").read_text())
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
