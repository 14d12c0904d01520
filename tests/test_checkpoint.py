"""Checkpoints as users meet them: resume, preemption signals, hard kills, corrupt files,
config changes, unwritable and full disks, another mesh. Real processes, real files.

Every resumed run is compared with one uninterrupted run of the same command: apart from
timings, its metrics.jsonl and its final parameters and optimizer state must be equal
bit for bit (CPU).

The runs of the tiny recipe train one PPO epoch per iteration (`runs.ONE_EPOCH`): these
tests check checkpoints, not learning, and all of them (the resume onto another mesh's
one-device run too) then share one compiled program.
"""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import runs

pytestmark = pytest.mark.slow


def _train_args(workdir, *overrides, **kwargs):
    """`runs.train_args` with one PPO epoch per iteration (the module's runs)."""
    return runs.train_args(workdir, *runs.ONE_EPOCH, *overrides, **kwargs)


def _arrays(workdir, step):
    """Every array of checkpoint `step` as numpy, keyed by item and tree path."""
    out = {}
    step_dir = os.path.join(workdir, "checkpoints", str(step))
    with ocp.StandardCheckpointer() as ckptr:
        for item in ("policy", "rest", "opt_state", "train"):
            tree = ckptr.restore(os.path.join(step_dir, item))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                out[item + jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def _assert_same_arrays(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 12-iteration run with a checkpoint every 3 iterations."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    proc = runs.run("train_ppo.py", *_train_args(workdir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "6", "9"]  # keep = 3
    return workdir


def test_sigkill_or_sigterm_at_any_moment_loses_at_most_the_work_since_the_last_checkpoint(
        reference, tmp_path):
    """One run stopped four times, each time started again by the same command: kill -9
    while compiling, kill -9 while the first checkpoint is written, SIGTERM (the iteration
    ends, a checkpoint of it is saved, exit 0; the next start continues from it), kill -9
    between two checkpoints. The start that finishes ends as the uninterrupted run."""
    workdir = tmp_path / "run"
    args = _train_args(workdir)
    # 1. Killed while compiling: nothing saved, the next start begins afresh.
    proc = runs.start("train_ppo.py", *args, log_path=tmp_path / "1.log")
    # (Polls every 50 ms where the moment to hit lasts seconds; every 5 ms for the save.)
    runs.wait_for(lambda: os.path.exists(workdir / "config.json"), proc=proc, poll=0.05)
    runs.kill(proc)
    # 2. Killed while the first checkpoint is being written.
    proc = runs.start("train_ppo.py", *args, log_path=tmp_path / "2.log")
    runs.wait_for(lambda: runs.metric_lines(workdir) >= 2, proc=proc, poll=0.05)
    runs.wait_for(lambda: glob.glob(str(workdir / "checkpoints" / "*.orbax-checkpoint-tmp*")),
                  proc=proc)
    runs.kill(proc)
    partial = glob.glob(str(workdir / "checkpoints" / "*.orbax-checkpoint-tmp*"))
    assert partial, "the kill did not land during a save"
    # 3. SIGTERM: saves the iteration it ends and exits 0.
    proc = runs.start("train_ppo.py", *args, log_path=tmp_path / "3.log")
    # (Its own 4th line: the killed start may have written a 4th one before this one
    # set the lines after its start aside.)
    runs.wait_for(lambda: "iter 4/12 " in (tmp_path / "3.log").read_text(), proc=proc,
                  poll=0.05)
    assert runs.kill(proc, signal.SIGTERM) == 0
    log3 = (tmp_path / "3.log").read_text()
    assert f"ignoring incomplete checkpoint {partial[0]}" in log3
    assert "resuming from checkpoint" not in log3  # the partial one was never loaded
    stopped = runs.metric_lines(workdir)
    assert f"preempted at iteration {stopped}, saved checkpoint {stopped}" in log3
    assert stopped < 12 and os.path.isdir(workdir / "checkpoints" / str(stopped))
    # 4. The same command continues from there; killed between two checkpoints, after
    # the third one.
    proc = runs.start("train_ppo.py", *args, log_path=tmp_path / "4.log")
    runs.wait_for(lambda: runs.metric_lines(workdir) >= 10, proc=proc, poll=0.05)
    runs.kill(proc)
    assert f"resuming from checkpoint {stopped} " in (tmp_path / "4.log").read_text()
    # 5. The same command finishes the run as if nothing had happened.
    proc = runs.run("train_ppo.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 9 unless the kill landed before its asynchronous save was committed.
    resumed = re.search(r"resuming from checkpoint (\d+) ", proc.stderr)
    assert resumed and int(resumed.group(1)) in (6, 9, stopped), proc.stderr[-3000:]
    runs.assert_same_metrics(reference / "metrics.jsonl", workdir / "metrics.jsonl")
    _assert_same_arrays(_arrays(reference, 12), _arrays(workdir, 12))


def test_corrupt_checkpoints_are_skipped_named_and_kept(reference, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    files12 = sorted(glob.glob(str(workdir / "checkpoints/12/policy/**/*"), recursive=True),
                     key=lambda p: os.path.getsize(p) if os.path.isfile(p) else -1)
    truncated = files12[-1]
    os.truncate(truncated, os.path.getsize(truncated) // 2)
    deleted = sorted(p for p in glob.glob(str(workdir / "checkpoints/9/opt_state/**/*"),
                                          recursive=True) if os.path.isfile(p))[0]
    os.remove(deleted)

    proc = runs.run("train_ppo.py", *_train_args(workdir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rel12 = os.path.relpath(truncated, workdir / "checkpoints" / "12")
    rel9 = os.path.relpath(deleted, workdir / "checkpoints" / "9")
    assert f"skipping checkpoint {workdir}/checkpoints/12: file {rel12} has" in proc.stderr
    assert f"skipping checkpoint {workdir}/checkpoints/9: file {rel9} is missing" in proc.stderr
    assert "resuming from checkpoint 6" in proc.stderr
    # Set aside for inspection, never deleted; the run then wrote 9 and 12 again.
    assert os.path.isdir(workdir / "checkpoints" / "corrupt-12")
    assert os.path.isdir(workdir / "checkpoints" / "corrupt-9")
    runs.assert_same_metrics(reference / "metrics.jsonl", workdir / "metrics.jsonl")
    _assert_same_arrays(_arrays(reference, 12), _arrays(workdir, 12))


def _tree_digest(root):
    return {os.path.relpath(p, root): open(p, "rb").read()
            for p in glob.glob(str(root / "**"), recursive=True) if os.path.isfile(p)}


def test_config_change_that_alters_the_run_is_refused(reference, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    before = _tree_digest(workdir)
    proc = runs.run("train_ppo.py", *_train_args(workdir, "--config.ppo.lr=0.001",
                                                  "--config.ppo.noptepochs=2"))
    assert proc.returncode == 2
    message = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(message) == 1 and "Traceback" not in proc.stderr
    assert "ppo.lr: checkpoint 0.003, now 0.001" in message[0]
    assert "ppo.noptepochs: checkpoint 1, now 2" in message[0]
    after = _tree_digest(workdir)
    # Nothing of the earlier run was touched; the per-process logs are append-only and
    # also record the refused launch.
    logs = {name for name in before if name.startswith("logs" + os.sep)}
    assert {k: v for k, v in after.items() if k not in logs} == {
        k: v for k, v in before.items() if k not in logs}
    assert all(after[name].startswith(before[name]) for name in logs)


def test_unwritable_checkpoint_directory_fails_before_training(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "checkpoints").write_text("a file where the checkpoint directory should be")
    proc = runs.run("train_ppo.py", *_train_args(workdir))
    assert proc.returncode == 1
    assert "error: checkpoint: cannot write checkpoints to" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (workdir / "metrics.jsonl").exists()


def test_full_disk_fails_at_the_first_save_with_one_message(tmp_path):
    """Files may not grow past 64 KiB (RLIMIT_FSIZE, as a disk that fills up): the first
    checkpoint cannot be written."""
    limit = ("import os, resource, signal, sys; "
             "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "  # EFBIG instead of a kill
             "resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10)); "
             "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
    workdir = tmp_path / "run"
    # The session's compilation cache, hard-linked into a private directory (the cache only
    # ever adds files): the programs are read from it (the same ones as the reference
    # run's), and an entry written and cut off at the limit stays in this copy.
    cache = tmp_path / "compilation_cache"
    shutil.copytree(os.environ["JAX_COMPILATION_CACHE_DIR"], cache, copy_function=os.link)
    proc = subprocess.run([sys.executable, "-c", limit,
                           *runs.command("train_ppo.py", *_train_args(workdir))[1:]],
                          env=runs.env(JAX_COMPILATION_CACHE_DIR=str(cache)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    message = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(message) == 1, proc.stderr[-3000:]
    assert message[0].startswith("error: checkpoint: saving checkpoint 3 to ")
    assert "do not fit there (File too large); free disk space" in message[0]
    assert "Traceback" not in proc.stderr
    assert runs.metric_lines(workdir) == 3  # stopped at the first save
    assert not os.listdir(workdir / "checkpoints")  # Orbax never started writing


def test_named_items_round_trip_and_empty_items_are_not_written(tmp_path):
    """Any stage's state: named pytrees in, the same out; an item without arrays has no
    directory and comes back as its target; "run" is the JSON's name."""
    import jax.numpy as jnp
    from pjit_ppo import checkpoint
    from pjit_ppo.config import CheckpointOptions
    items = {"params": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)},
             "counters": {"step": jnp.int32(7)}, "nothing": {}}
    ckpt = checkpoint.RunCheckpointer(str(tmp_path), CheckpointOptions(async_save=False))
    ckpt.save(5, items, {"note": "hello"})
    step_dir = tmp_path / "checkpoints" / "5"
    assert {"params", "counters", "run"} <= set(os.listdir(step_dir))
    assert "nothing" not in os.listdir(step_dir)
    assert checkpoint.verify(str(step_dir)) is None
    out = ckpt.restore(5, items)
    assert out["nothing"] == {}
    for name in ("params", "counters"):
        for a, b in zip(jax.tree.leaves(items[name]), jax.tree.leaves(out[name])):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ckpt.run_info(5)["note"] == "hello"
    step, counters = ckpt.restore_item(None, "counters", items["counters"])
    assert step == 5 and int(counters["step"]) == 7
    with pytest.raises(ValueError, match="checkpoint item name 'run'"):
        ckpt.save(6, {"run": items["params"]}, {})


RESTORE = """
import functools, importlib.util, sys
import jax, numpy as np
from pjit_ppo import checkpoint, sharding
from pjit_ppo.ppo import run, state_io
workdir, out, step, recipe = sys.argv[1:5]
spec = importlib.util.spec_from_file_location("recipe", recipe)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
make_mesh = sharding.make_mesh
for devices, fsdp, tensor in ((4, 2, 2), (2, 1, 2), (1, 1, 1)):
    # The run's own layout on the first `devices` devices of this process: what a
    # process with that many devices builds.
    sharding.make_mesh = functools.partial(make_mesh, devices=jax.devices()[:devices])
    config = module.get_config()
    config.mesh.fsdp, config.mesh.tensor, config.measure_peak = fsdp, tensor, False
    state = run.build(config).state
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = state_io.from_items(checkpoint.RunCheckpointer(workdir, read_only=True).restore(
        int(step), state_io.to_items(target)))
    w = restored.params["policy"]["transformer/layers/attn/q"]["w"]
    assert w.sharding == target.params["policy"]["transformer/layers/attn/q"]["w"].sharding
    np.savez(f"{out}_{devices}.npz", **{jax.tree_util.keystr(p): np.asarray(x)
                                         for p, x in jax.tree_util.tree_leaves_with_path(restored)})
    print("restored onto", len(w.sharding.device_set), "devices:", w.sharding.spec, flush=True)
"""


def test_restore_onto_another_mesh(tmp_path):
    """Saved on 4 devices (fsdp 2 x tensor 2); restored on 4, 2 (fsdp 1 x tensor 2) and 1
    devices with abstract targets in each layout's own shardings (as a process with that
    many devices builds them; one 4-device process restores all three, each on its first
    devices): every array equal. Then the run resumes on one device with more iterations
    (mesh and num_iterations may change on resume). 4 devices, not 8: on a 2-CPU test
    machine each fake device more makes every step dearer, and the 2-device restore still
    splits arrays differently (fsdp 2 -> 1) and the 1-device one gathers them whole. One
    iteration before the checkpoint: its arrays (Adam moments, counts) are all written."""
    workdir = tmp_path / "run"
    proc = runs.run("train_ppo.py", *_train_args(workdir, "--config.mesh.fsdp=2",
                                                  "--config.mesh.tensor=2", iterations=1,
                                                  every=1),
                    devices=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "restored"
    proc = subprocess.run([sys.executable, "-c", RESTORE, str(workdir), str(out), "1",
                           runs.TINY], env=runs.env(4), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dumps = {}
    for devices in (4, 2, 1):
        assert f"restored onto {devices} devices" in proc.stdout
        dumps[devices] = dict(np.load(f"{out}_{devices}.npz"))
    assert len(dumps[4]) > 20  # policy, critic, both Adam moments, counts, kl_coef, iteration
    _assert_same_arrays(dumps[4], dumps[2])
    _assert_same_arrays(dumps[4], dumps[1])

    # Changes a resume allows: another mesh (1 device now) and a longer run.
    proc = runs.run("train_ppo.py", *_train_args(workdir, iterations=2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from checkpoint 1" in proc.stderr
    lines = runs.strict_lines(workdir / "metrics.jsonl")
    assert [r["iteration"] for r in lines] == [1, 2]


def test_sigint_saves_and_exits_cleanly_and_a_critic_free_run_resumes(tmp_path):
    """configs/grpo_demo.py through the entry point, stopped by SIGINT (Ctrl-C): the
    iteration ends, a checkpoint of it is saved (none is due by checkpoint.every), exit 0.
    4 samples per prompt, no critic in the checkpoint, value metrics absent; the same
    command resumes from it and finishes."""
    workdir = tmp_path / "grpo"
    recipe = os.path.join(runs.ROOT, "configs", "grpo_demo.py")
    args = (f"--config={recipe}", f"--workdir={workdir}", "--config.num_iterations=8",
            "--config.checkpoint.every=100", "--config.measure_peak=false", *runs.ONE_EPOCH)
    proc = runs.start("train_ppo.py", *args, log_path=tmp_path / "log")
    runs.wait_for(lambda: runs.metric_lines(workdir) >= 2, proc=proc, poll=0.05)
    assert runs.kill(proc, signal.SIGINT) == 0
    stopped = runs.metric_lines(workdir)
    assert f"preempted at iteration {stopped}, saved checkpoint {stopped}" in (
        tmp_path / "log").read_text()
    from pjit_ppo import checkpoint
    assert checkpoint.verify(str(workdir / "checkpoints" / str(stopped))) is None
    items = set(os.listdir(workdir / "checkpoints" / str(stopped)))
    assert {"policy", "opt_state", "train", "run"} <= items and "rest" not in items
    lines = runs.strict_lines(workdir / "metrics.jsonl")
    assert "grpo/group_reward_std" in lines[0]
    assert not any(k.startswith("ppo/val/") for k in lines[0])
    proc = runs.run("train_ppo.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from checkpoint {stopped} " in proc.stderr
    assert [r["iteration"] for r in runs.strict_lines(workdir / "metrics.jsonl")] == list(
        range(1, 9))
