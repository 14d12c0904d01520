"""The shared supervised loop (pjit_ppo/loop.py) as users of the SFT and reward-learning
stages meet it: kill -9 and the same command again, SIGTERM and the same command again, a
changed config or changed data on resume, a run that diverges. Real entry-point
processes, real signals, real files.

Each interrupted run is compared with one uninterrupted run of the same command: apart
from timings its metrics.jsonl, its last checkpoint's arrays and its output model files
must be equal bit for bit (CPU).

The recipes save a checkpoint every EVERY steps (and keep 2): enough mid-run checkpoints
for a SIGTERM, a kill -9 after a later one and a resume before the end, while a save
costs more than a step of these tiny models.
"""
import functools
import glob
import os
import re
import shutil
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import runs
import tiny_text
from test_reward_learning import write_labels

pytestmark = pytest.mark.slow

#: Steps between checkpoints of the recipes (checkpoint.every; keep=2).
EVERY = 6

SFT_RECIPE = """
from pjit_ppo.config import CheckpointOptions, ModelOptions, SFTConfig


def get_config(arg=""):
    return SFTConfig(model=ModelOptions(random={random!r}), data_path={corpus!r},
                     tokenizer_path={tok!r}, seq_length=12, batch_size=16,
                     gradient_accumulation_steps=2, max_steps=30, lr=3e-3, warmup_steps=3,
                     log_every=5, eval_every=8, eval_fraction=0.1,
                     checkpoint=CheckpointOptions(every={every}, keep=2))
"""

#: SFT with LoRA adapters (dropout on: every step draws its own keys, also after a resume).
SFT_LORA_RECIPE = SFT_RECIPE.replace("ModelOptions(random={random!r})",
                                     "ModelOptions(random={random!r}, lora=dict(rank=4, "
                                     "alpha=8.0, dropout=0.1))")

REWARD_RECIPE = """
from pjit_ppo.config import CheckpointOptions, ModelOptions, RewardLearningConfig


def get_config(arg=""):
    return RewardLearningConfig(
        model=ModelOptions(random={random!r}), labels_path={labels!r}, tokenizer_path={tok!r},
        query_length=6, response_length=6, pad_token_id=1, truncate_token=None, batch_size=8,
        gradient_accumulation_steps=2, lr=1e-3, num_epochs=2, norm_samples=16,
        norm_batch_size=8, log_every=5, eval_every=8,
        checkpoint=CheckpointOptions(every={every}, keep=2))
"""

#: stage -> (entry point, output directory, its files compared byte for byte, total steps)
STAGES = {
    "sft": ("train_sft.py", "model", ("model.safetensors", "config.json"), 30),
    "sft_lora": ("train_sft.py", "model", ("model.safetensors", "config.json"), 30),
    # 100 labels: 10 held out, 90 -> 11 steps of 8 per epoch, 2 epochs.
    "reward": ("train_reward.py", "reward_model",
               ("model.safetensors", "reward_head.safetensors", "reward_model.json"), 22),
}


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """stage -> recipe path (tiny model, tiny data, a checkpoint every EVERY steps)."""
    d = tmp_path_factory.mktemp("stage_data")
    tiny_text.save_tokenizer(str(d / "tok"))
    (d / "corpus.txt").write_text("\n".join(tiny_text.sentences(300)) + "\n")
    labels = write_labels(d / "labels.jsonl", 100, 0)
    fields = dict(random=tiny_text.model_random(), tok=str(d / "tok"), every=EVERY)
    (d / "sft.py").write_text(SFT_RECIPE.format(corpus=str(d / "corpus.txt"), **fields))
    (d / "reward.py").write_text(REWARD_RECIPE.format(labels=labels, **fields))
    (d / "sft_lora.py").write_text(SFT_LORA_RECIPE.format(corpus=str(d / "corpus.txt"),
                                                          **fields))
    return {"sft": str(d / "sft.py"), "reward": str(d / "reward.py"),
            "sft_lora": str(d / "sft_lora.py"), "corpus": d / "corpus.txt"}


def _last_before(total):
    """The last checkpoint step of a run of `total` steps before its final one."""
    return (total - 1) // EVERY * EVERY


def _args(recipes, stage, workdir, *overrides):
    return (f"--config={recipes[stage]}", f"--workdir={workdir}", *overrides)


@pytest.fixture(scope="module")
def references(recipes, tmp_path_factory):
    """stage -> the work directory of one uninterrupted run."""
    out = {}
    for stage, (script, _, _, total) in STAGES.items():
        workdir = tmp_path_factory.mktemp(f"uninterrupted_{stage}")
        proc = runs.run(script, *_args(recipes, stage, workdir))
        assert proc.returncode == 0, proc.stderr[-3000:]
        # keep=2: the last mid-run checkpoint and the final one.
        assert sorted(os.listdir(workdir / "checkpoints"), key=int) == [
            str(_last_before(total)), str(total)]
        out[stage] = workdir
    return out


def _arrays(workdir, step):
    """Every array of checkpoint `step` as numpy, keyed by item and tree path."""
    out = {}
    with ocp.StandardCheckpointer() as ckptr:
        for item in ("params", "opt_state"):
            tree = ckptr.restore(os.path.join(workdir, "checkpoints", str(step), item))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                out[item + jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


@functools.lru_cache(maxsize=None)
def _reference_arrays(reference, step):
    """`_arrays` of an uninterrupted run (never changed once made), read once."""
    return _arrays(reference, step)


def _assert_same_run(stage, reference, workdir):
    """metrics.jsonl (timings aside), the last checkpoint and the output files equal."""
    _, output, files, total = STAGES[stage]
    runs.assert_same_metrics(reference / "metrics.jsonl", workdir / "metrics.jsonl")
    a, b = _reference_arrays(reference, total), _arrays(workdir, total)
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    for name in files:
        assert (reference / output / name).read_bytes() == (workdir / output / name).read_bytes(), \
            name


def _checkpoints(workdir):
    return sorted(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit()) \
        if os.path.isdir(workdir / "checkpoints") else []


@pytest.mark.parametrize("stage", ["sft", "reward", "sft_lora"])
def test_sigterm_then_kill_9_then_same_command_ends_as_uninterrupted(recipes, references, stage,
                                                                     tmp_path):
    """One run interrupted twice, as a user meets it: SIGTERM saves and exits 0, and the
    same command continues from that checkpoint; kill -9 of that run after a later
    checkpoint (>= 6), and the same command again ends as the uninterrupted run."""
    script, output, _, total = STAGES[stage]
    workdir = tmp_path / "run"
    args = _args(recipes, stage, workdir)
    # 1. SIGTERM: finish the step, save it, exit 0.
    proc = runs.start(script, *args, log_path=tmp_path / "1.log")
    runs.wait_for(lambda: runs.metric_lines(workdir) >= 3, proc=proc)
    assert runs.kill(proc, signal.SIGTERM) == 0
    log = (tmp_path / "1.log").read_text()
    stopped = int(re.search(r"preempted at step (\d+), saved checkpoint (\d+)", log).group(1))
    assert f"preempted at step {stopped}, saved checkpoint {stopped}" in log
    assert 0 < stopped < total and not os.path.exists(workdir / output)
    from pjit_ppo import checkpoint
    assert checkpoint.verify(str(workdir / "checkpoints" / str(stopped))) is None

    # 2. The same command continues from that checkpoint; kill -9 after a later one.
    proc = runs.start(script, *args, log_path=tmp_path / "2.log")
    later = max(6, stopped + 1)
    runs.wait_for(lambda: any(s >= later for s in _checkpoints(workdir)), proc=proc)
    runs.kill(proc)
    assert f"resuming from checkpoint {stopped} " in (tmp_path / "2.log").read_text()
    assert not os.path.exists(workdir / output), "the kill came after the run had finished"
    written = runs.strict_lines(workdir / "metrics.jsonl")

    # 3. The same command again: from the last complete checkpoint to the end.
    proc = runs.run(script, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = int(re.search(r"resuming from checkpoint (\d+) ", proc.stderr).group(1))
    assert 6 <= resumed < total
    dropped = [line for line in written if line["iteration"] > resumed]
    if dropped:  # lines after the checkpoint were moved aside, not lost
        assert len(runs.strict_lines(workdir / "metrics.jsonl.dropped")) == len(dropped)
    _assert_same_run(stage, references[stage], workdir)


def _tree_bytes(root):
    return {os.path.relpath(p, root): open(p, "rb").read()
            for p in glob.glob(str(root / "**"), recursive=True) if os.path.isfile(p)}


def _one_error_line(proc):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("stage,change,named", [
    ("sft", ("--config.lr=0.01", "--config.log_every=4"),
     ("lr: checkpoint 0.003, now 0.01", "log_every: checkpoint 5, now 4")),
    ("reward", ("--config.norm_samples=32",), ("norm_samples: checkpoint 16, now 32",)),
])
def test_changed_config_is_refused_and_nothing_is_touched(recipes, references, stage, change,
                                                         named, tmp_path):
    script = STAGES[stage][0]
    workdir = tmp_path / "run"
    shutil.copytree(references[stage], workdir)
    before = _tree_bytes(workdir)
    message = _one_error_line(runs.run(script, *_args(recipes, stage, workdir, *change)))
    assert message.startswith("error: invalid config: cannot resume from checkpoint "), message
    for field in named:
        assert field in message, message
    assert _tree_bytes(workdir) == before
    # Layout, checkpointing and logging may change: the finished run is found finished.
    proc = runs.run(script, *_args(recipes, stage, workdir, "--config.checkpoint.every=3",
                                   "--config.tensorboard=false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from checkpoint {STAGES[stage][3]} " in proc.stderr
    _assert_same_run(stage, references[stage], workdir)


def test_changed_corpus_is_refused_and_nothing_is_touched(recipes, references, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(references["sft"], workdir)
    before = _tree_bytes(workdir)
    corpus = recipes["corpus"]
    original = corpus.read_bytes()
    try:
        corpus.write_text("\n".join(tiny_text.sentences(300, seed=1)) + "\n")
        message = _one_error_line(runs.run("train_sft.py", *_args(recipes, "sft", workdir)))
    finally:
        corpus.write_bytes(original)
    assert re.match(r"error: data: cannot resume from checkpoint 30 in .*: its training data "
                    r"were \d+ rows, crc32 \w+, now \d+ rows, crc32 \w+; restore the original "
                    r"files", message), message
    assert _tree_bytes(workdir) == before


def test_reward_normalisation_is_in_every_checkpoint(references):
    """The gain and bias set before training are part of the saved params (a resume restores
    them, it does not sample again), and the last checkpoint holds the final ones."""
    workdir = references["reward"]
    lines = runs.strict_lines(workdir / "metrics.jsonl")
    before = next(m for m in lines if "normalization/std_before" in m)
    trained = next(m for m in lines if "normalization/std_trained" in m)
    head = {k.split("'")[-2]: v for k, v in _arrays(workdir, _last_before(22)).items()
            if k.startswith("params['reward_head']")}
    std, mean = np.float32(before["normalization/std_before"]), before[
        "normalization/mean_before"]
    np.testing.assert_allclose(head["gain"], np.float32(1.0) / std, rtol=1e-6)
    np.testing.assert_allclose(head["bias"], -np.float32(mean) / std, rtol=1e-6)
    final = {k.split("'")[-2]: v for k, v in _arrays(workdir, 22).items()
             if k.startswith("params['reward_head']")}
    a = 1.0 / trained["normalization/std_trained"]
    np.testing.assert_allclose(final["gain"], head["gain"] * a, rtol=1e-5)
    from pjit_ppo.models import heads
    saved = heads.load_reward_head(str(workdir / "reward_model"), 32)["reward_head"]
    for key in ("gain", "bias", "w"):
        np.testing.assert_array_equal(np.asarray(saved[key]), final[key])


def test_diverging_run_stops_with_one_line_naming_quantity_and_step(recipes, tmp_path):
    """float16 activations and lr 1: the gradient overflows after a few steps (which one
    depends on the CPU's code generation: step 4 or 5 on the machines seen so far). One
    error line names the quantity and the step; nothing is saved for that step, no model
    is written, and the checkpoints of the steps before it are whole, the one still being
    written when the step failed included."""
    from pjit_ppo import checkpoint
    workdir = tmp_path / "run"
    proc = runs.run("train_sft.py", *_args(recipes, "sft", workdir, "--config.lr=1.0",
                                           "--config.max_grad_norm=1e30",
                                           "--config.warmup_steps=0",
                                           "--config.model.compute_dtype=float16",
                                           "--config.checkpoint.every=2"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    failed = re.fullmatch(r"error: training stopped: train/grad_norm = nan at step (\d+): "
                          r"lower lr or set max_grad_norm", errors[0])
    assert failed, errors[0]
    step = int(failed.group(1))
    assert 3 <= step < 30, errors[0]
    assert "Traceback" not in proc.stderr
    # every 2, keep 2: the last two even steps before the failing one.
    assert _checkpoints(workdir) == [s for s in range(2, step, 2)][-2:]
    for s in _checkpoints(workdir):
        assert checkpoint.verify(str(workdir / "checkpoints" / str(s))) is None, s
    assert not os.path.exists(workdir / "model")
