"""Metric writers: JSONL round trip, TensorBoard files, console ETA, chief only."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjit_ppo import metrics


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_jsonl_round_trip_and_append(tmp_path):
    path = str(tmp_path / "run" / "metrics.jsonl")
    writer = metrics.JsonlWriter(path)
    writer.write(1, {"a": np.float32(0.5), "b": jnp.asarray(2.25),
                     "c": 3, "d": np.int64(7)})
    writer.write(2, {"a": 1.5, "b": jnp.float32(-1.0)})
    writer.close()

    rows = _read_jsonl(path)
    assert rows == [{"iteration": 1, "a": 0.5, "b": 2.25, "c": 3, "d": 7},
                    {"iteration": 2, "a": 1.5, "b": -1.0}]
    assert isinstance(rows[0]["b"], float)

    # A resumed run reopens the file and appends.
    with metrics.JsonlWriter(path) as writer:
        writer.write(3, {"a": float("nan")})
    rows = _read_jsonl(path)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert np.isnan(rows[2]["a"])


def test_jsonl_flushes_each_line(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    writer = metrics.JsonlWriter(path)
    writer.write(1, {"x": 1.0})
    # Readable before close: a crash here would not lose the line.
    assert _read_jsonl(path) == [{"iteration": 1, "x": 1.0}]
    writer.close()


def test_rejects_non_scalar(tmp_path):
    writer = metrics.JsonlWriter(str(tmp_path / "m.jsonl"))
    with pytest.raises(ValueError):
        writer.write(1, {"x": np.zeros(3)})
    writer.close()


def test_tensorboard_writes_event_file(tmp_path):
    logdir = str(tmp_path / "tb")
    writer = metrics.TensorBoardWriter(logdir)
    writer.write(1, {"objective/scores": np.float32(0.25)})
    writer.write(2, {"objective/scores": jnp.asarray(0.5)})
    writer.close()
    files = os.listdir(logdir)
    assert any(name.startswith("events.out.tfevents") for name in files)
    event_file = os.path.join(logdir, files[0])
    assert os.path.getsize(event_file) > 0
    with open(event_file, "rb") as f:
        assert b"objective/scores" in f.read()


def test_console_line_has_eta():
    now = [100.0]
    lines = []
    writer = metrics.ConsoleWriter(
        total_iterations=10, keys=("objective/scores", "ppo/lr", "missing"),
        print_fn=lines.append, clock=lambda: now[0])
    now[0] = 104.0  # two iterations in 4 s -> 2 s each, 8 left -> 16 s
    writer.write(2, {"objective/scores": np.float32(0.123456), "ppo/lr": 1e-5,
                     "other": 3.0})
    line = lines[-1]
    assert line.startswith("iter 2/10")
    assert "elapsed 0:00:04" in line
    assert "ETA 0:00:16" in line
    assert "objective/scores 0.1235" in line
    assert "ppo/lr 1e-05" in line
    assert "missing" not in line and "other" not in line


def test_console_eta_after_resume():
    now = [0.0]
    lines = []
    writer = metrics.ConsoleWriter(total_iterations=100, keys=(), start_step=50,
                                   print_fn=lines.append, clock=lambda: now[0])
    writer.write(50, {})  # nothing done yet since the resume: unknown ETA
    assert "ETA ?" in lines[-1]
    now[0] = 10.0
    writer.write(60, {})  # 1 s per iteration, 40 left
    assert "ETA 0:00:40" in lines[-1]


def test_make_writers(tmp_path):
    workdir = str(tmp_path / "work")
    writer = metrics.make_writers(workdir, total_iterations=3,
                                  console_keys=("x",))
    writer.write(1, {"x": 1.0})
    writer.close()
    assert _read_jsonl(os.path.join(workdir, "metrics.jsonl")) == [
        {"iteration": 1, "x": 1.0}]
    assert os.listdir(os.path.join(workdir, "tensorboard"))

    workdir2 = str(tmp_path / "work2")
    writer = metrics.make_writers(workdir2, 3, tensorboard=False)
    writer.write(1, {"x": 1.0})
    writer.close()
    assert not os.path.exists(os.path.join(workdir2, "tensorboard"))


def test_noop_off_process_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
    workdir = str(tmp_path / "work")
    lines = []
    writers = [metrics.make_writers(workdir, total_iterations=3),
               metrics.ConsoleWriter(3, keys=("x",), print_fn=lines.append)]
    for writer in writers:
        writer.write(1, {"x": 1.0})
        writer.close()
    assert not os.path.exists(workdir)
    assert lines == []


def test_device_memory_stats():
    stats = metrics.device_memory_stats()
    assert isinstance(stats, dict)
    if all(d.memory_stats() is None for d in jax.local_devices()):
        assert stats == {}
    for key, value in stats.items():
        assert key.startswith("memory/") and value >= 0.0
