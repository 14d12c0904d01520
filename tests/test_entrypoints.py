"""The train entry point as a user runs it: a real subprocess, real files on disk."""
import json
import os
import subprocess
import sys

import pytest

import runs
from runs import TINY, strict_lines as _strict_lines


def _train(args, cwd, timeout=600, script=None):
    """launch/train_ppo.py (or `script`) with `args`, on one CPU device, from `cwd`."""
    command = list(script) if script else runs.command("train_ppo.py")
    return subprocess.run([*command, *args], cwd=cwd, env=runs.env(), capture_output=True,
                          text=True, timeout=timeout)


def test_demo_recipe_runs_from_another_directory(tmp_path):
    """The recipe is found by path from any cwd (no sys.path tricks), metrics are strict
    JSON with one line per iteration, and compilation is timed on its own."""
    workdir = tmp_path / "run"
    proc = _train([f"--config={TINY}", f"--workdir={workdir}", "--config.num_iterations=3",
                   "--config.measure_peak=false", "--config.checkpoint.every=100"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # No line that tells a user nothing: jax's probe for a TPU backend stays off the console.
    assert "libtpu" not in proc.stderr and "initialize backend" not in proc.stderr
    lines = _strict_lines(workdir / "metrics.jsonl")
    assert [m["iteration"] for m in lines] == [1, 2, 3]
    assert "time/compile_s" in lines[0] and all("time/compile_s" not in m for m in lines[1:])
    assert lines[0]["time/compile_s"] > lines[1]["time/update_s"]
    for m in lines:
        assert 0.0 <= m["objective/scores"] <= 1.0
        assert m["objective/kl_coef"] == pytest.approx(0.05)
    config = json.loads((workdir / "config.json").read_text())
    assert config["num_iterations"] == 3 and config["ppo"]["batch_size"] == 64
    assert (workdir / "tensorboard").is_dir()
    # num_iterations is the one run length: the LR anneals to 0 over exactly 3 updates.
    lrs = [m["ppo/lr"] for m in lines]
    assert lrs == pytest.approx([3e-3, 2e-3, 1e-3], rel=1e-5)


def test_reward_model_path_with_critic_from_reward(tmp_path):
    """reward.kind='model': a (random) reward model scores responses and the critic
    starts from its trunk; the console script is the same program."""
    script = os.path.join(os.path.dirname(sys.executable), "pjit-ppo-train")
    assert os.path.exists(script), "pip install -e . installs the pjit-ppo-train script"
    workdir = tmp_path / "rm"
    proc = _train([f"--config={TINY}", f"--workdir={workdir}", "--config.num_iterations=2",
                   "--config.reward.kind=model", "--config.ppo.critic_init=reward",
                   "--config.ppo.batch_size=16", "--config.ppo.nminibatches=1",
                   "--config.measure_peak=false"], cwd=tmp_path, script=(script,))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _strict_lines(workdir / "metrics.jsonl")
    assert len(lines) == 2
    # A random reward head gives real-valued scores, not the token-fraction in [0, 1] grid.
    scores = [m["objective/scores"] for m in lines]
    assert all(isinstance(s, float) for s in scores) and len(set(scores)) == 2
    assert abs(lines[0]["objective/kl"]) < 1e-4  # policy == reference at the start
    assert lines[1]["ppo/val/error"] is not None


def test_invalid_value_fails_fast_and_keeps_the_previous_run(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text('{"previous": true}')
    (workdir / "metrics.jsonl").write_text('{"iteration": 1}\n')
    proc = _train([f"--config={TINY}", f"--workdir={workdir}", "--config.ppo.temperature=0"],
                  cwd=tmp_path)
    assert proc.returncode == 2
    assert "ppo.temperature" in proc.stderr and "must be > 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (workdir / "config.json").read_text() == '{"previous": true}'
    assert (workdir / "metrics.jsonl").read_text() == '{"iteration": 1}\n'


def test_unknown_field_and_missing_workdir_are_rejected(tmp_path):
    proc = _train([f"--config={TINY}", f"--workdir={tmp_path}", "--config.ppo.lrr=1"],
                  cwd=tmp_path)
    assert proc.returncode != 0 and "lrr" in proc.stderr
    proc = _train([f"--config={TINY}"], cwd=tmp_path)
    assert proc.returncode != 0 and "workdir" in proc.stderr
    assert not (tmp_path / "config.json").exists()


def test_divergence_stops_with_the_quantity_and_a_fix(tmp_path):
    """A learning rate that blows up the policy stops the run with one message naming the
    first non-finite quantity; metrics.jsonl stays strict JSON up to that iteration."""
    workdir = tmp_path / "run"
    proc = _train([f"--config={TINY}", f"--workdir={workdir}", "--config.num_iterations=6",
                   "--config.ppo.lr=1e30", "--config.ppo.optimizer=adam",
                   "--config.measure_peak=false"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    message = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(message) == 1, proc.stderr[-3000:]
    from pjit_ppo.ppo.trainer import GUARDED
    assert any(message[0].startswith(f"error: training stopped: {key} = ") for key, _ in GUARDED)
    assert "ppo.lr" in message[0] and "Traceback" not in proc.stderr
    lines = _strict_lines(workdir / "metrics.jsonl")
    assert lines and f"at iteration {lines[-1]['iteration']}:" in message[0]
