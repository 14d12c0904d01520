"""DPO through its entry point as users meet the shared loop: kill -9 and the same command
again (reference log-probs precomputed and read back from the run, or computed per batch
by a reference rebuilt from the initial policy), SIGTERM and the same command again (one
run interrupted twice: SIGTERM, then kill -9), a changed config on resume. Real
subprocesses, real signals, real files.

Each interrupted run is compared with one uninterrupted run of the same command: apart
from timings its metrics.jsonl, its last checkpoint's arrays and its output model must
be equal bit for bit (CPU).
"""
import os
import re
import shutil
import signal

import numpy as np
import pytest

import runs
import tiny_text
from test_reward_learning import write_labels
from test_stage_resume import _arrays, _checkpoints, _one_error_line, _tree_bytes

pytestmark = pytest.mark.slow

RECIPE = """
from pjit_ppo.config import CheckpointOptions, DPOConfig, ModelOptions


def get_config(arg=""):
    return DPOConfig(
        model=ModelOptions(random={random!r}), labels_path={labels!r}, tokenizer_path={tok!r},
        query_length=6, response_length=6, pad_token_id=1, truncate_token=None, batch_size=16,
        gradient_accumulation_steps=2, lr=1e-3, beta=0.2, max_steps=20, log_every=5,
        eval_every=8, checkpoint=CheckpointOptions(every={every}, keep=2))
"""
TOTAL = 20
#: Steps between checkpoints (keep=2): mid-run checkpoints at 5, 10 and 15, fewer saves.
EVERY = 5
MODES = {"precomputed": (), "per_batch": ("--config.precompute_ref=false",)}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo_data")
    tiny_text.save_tokenizer(str(d / "tok"))
    labels = write_labels(d / "labels.jsonl", 100, 0)  # 90 training labels -> 270 pairs
    (d / "dpo.py").write_text(RECIPE.format(random=tiny_text.model_random(), labels=labels,
                                            tok=str(d / "tok"), every=EVERY))
    return str(d / "dpo.py")


def _args(recipe, workdir, *overrides):
    return (f"--config={recipe}", f"--workdir={workdir}", *overrides)


@pytest.fixture(scope="module")
def references(recipe, tmp_path_factory):
    """mode -> the work directory of one uninterrupted run."""
    out = {}
    for mode, overrides in MODES.items():
        workdir = tmp_path_factory.mktemp(f"uninterrupted_{mode}")
        proc = runs.run("train_dpo.py", *_args(recipe, workdir, *overrides))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _checkpoints(workdir) == [TOTAL - EVERY, TOTAL]
        out[mode] = workdir
    return out


def _assert_same_run(reference, workdir):
    runs.assert_same_metrics(reference / "metrics.jsonl", workdir / "metrics.jsonl")
    a, b = _arrays(reference, TOTAL), _arrays(workdir, TOTAL)
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (reference / "model" / name).read_bytes() == (workdir / "model" / name).read_bytes()


def test_kill_9_then_same_command_ends_as_uninterrupted(recipe, references, tmp_path):
    """Reference log-probs computed per batch (precompute_ref=false): kill -9 after a
    checkpoint (>= 6) and the same command again ends as the uninterrupted run, with no
    reference log-probs file. The precomputed mode is killed the same way in
    test_sigterm_then_kill_9_then_same_command_ends_as_uninterrupted."""
    mode = "per_batch"
    workdir = tmp_path / "run"
    args = _args(recipe, workdir, *MODES[mode])
    proc = runs.start("train_dpo.py", *args, log_path=tmp_path / "1.log")
    runs.wait_for(lambda: any(s >= 6 for s in _checkpoints(workdir)), proc=proc)
    runs.kill(proc)
    assert not os.path.exists(workdir / "model"), "the kill came after the run had finished"

    proc = runs.run("train_dpo.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = int(re.search(r"resuming from checkpoint (\d+) ", proc.stderr).group(1))
    assert 6 <= resumed < TOTAL
    assert not (workdir / "reference_logps.npz").exists()
    _assert_same_run(references[mode], workdir)


def test_sigterm_then_kill_9_then_same_command_ends_as_uninterrupted(recipe, references,
                                                                     tmp_path):
    """Reference log-probs precomputed (the default), one run interrupted twice: SIGTERM
    saves and exits 0, and the same command continues from that checkpoint; kill -9 of
    that run after a later checkpoint (>= 6), and the same command again reads the
    reference log-probs saved with the run before step 1 (not recomputed) and ends as
    the uninterrupted run."""
    mode = "precomputed"
    workdir = tmp_path / "run"
    args = _args(recipe, workdir, *MODES[mode])
    # 1. SIGTERM: finish the step, save it, exit 0.
    proc = runs.start("train_dpo.py", *args, log_path=tmp_path / "1.log")
    runs.wait_for(lambda: runs.metric_lines(workdir) >= 2, proc=proc)
    assert runs.kill(proc, signal.SIGTERM) == 0
    log = (tmp_path / "1.log").read_text()
    stopped = int(re.search(r"DPO preempted at step (\d+), saved checkpoint", log).group(1))
    assert f"preempted at step {stopped}, saved checkpoint {stopped}" in log
    assert 0 < stopped < TOTAL and not os.path.exists(workdir / "model")

    # 2. The same command continues from that checkpoint; kill -9 after a later one.
    proc = runs.start("train_dpo.py", *args, log_path=tmp_path / "2.log")
    later = max(6, stopped + 1)
    runs.wait_for(lambda: any(s >= later for s in _checkpoints(workdir)), proc=proc)
    runs.kill(proc)
    log = (tmp_path / "2.log").read_text()
    assert f"resuming from checkpoint {stopped} " in log
    assert "reference log-probs read from" in log
    assert not os.path.exists(workdir / "model"), "the kill came after the run had finished"

    # 3. The same command again: from the last complete checkpoint to the end.
    proc = runs.run("train_dpo.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = int(re.search(r"resuming from checkpoint (\d+) ", proc.stderr).group(1))
    assert 6 <= resumed < TOTAL
    # saved with the run before step 1, read back, not recomputed
    assert "reference log-probs read from" in proc.stderr
    assert (workdir / "reference_logps.npz").read_bytes() == (
        references[mode] / "reference_logps.npz").read_bytes()
    _assert_same_run(references[mode], workdir)


def test_changed_objective_is_refused_and_nothing_is_touched(recipe, references, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(references["precomputed"], workdir)
    before = _tree_bytes(workdir)
    message = _one_error_line(runs.run("train_dpo.py", *_args(
        recipe, workdir, "--config.beta=0.5", "--config.loss_type=ipo")))
    assert message.startswith("error: invalid config: cannot resume from checkpoint 20 "), message
    for field in ("beta: checkpoint 0.2, now 0.5", "loss_type: checkpoint 'sigmoid', now 'ipo'"):
        assert field in message, message
    assert _tree_bytes(workdir) == before
