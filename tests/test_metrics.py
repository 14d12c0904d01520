"""Metric writers: JSONL round trip, TensorBoard files, console ETA, chief only."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjit_ppo import metrics


def _reject_constant(name):
    raise ValueError(f"not strict JSON: {name}")


def _read_jsonl(path):
    """Parses every line strictly: the tokens NaN, Infinity and -Infinity are errors."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line, parse_constant=_reject_constant) for line in f]


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
        writer.write(3, {"a": 0.25})
    rows = _read_jsonl(path)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[2]["a"] == 0.25


def test_strict_parser_rejects_nan():
    # The check below is only meaningful if _read_jsonl really refuses NaN tokens.
    with pytest.raises(ValueError, match="not strict JSON"):
        json.loads('{"a": NaN}', parse_constant=_reject_constant)


def test_jsonl_writes_non_finite_values_as_null(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    with metrics.JsonlWriter(path) as writer:
        writer.write(1, {"nan": float("nan"), "inf": float("inf"), "ninf": -np.inf,
                         "f32_nan": np.float32("nan"), "jax_inf": jnp.asarray(jnp.inf),
                         "ok": 1.5, "zero": 0.0, "int": 4, "flag": True})
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert "NaN" not in text and "Infinity" not in text
    assert _read_jsonl(path) == [{"iteration": 1, "nan": None, "inf": None, "ninf": None,
                                  "f32_nan": None, "jax_inf": None, "ok": 1.5, "zero": 0.0,
                                  "int": 4, "flag": True}]


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


class _FakeDevice:
    """Stands in for a jax device: memory_stats() returns `stats`, or raises it."""

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_device_memory_stats_takes_maxima_in_mib():
    mib = 2**20
    devices = [
        _FakeDevice({"bytes_in_use": 3 * mib, "peak_bytes_in_use": 10 * mib,
                     "bytes_limit": 100 * mib}),
        _FakeDevice(None),  # CPU-like backend
        _FakeDevice(RuntimeError("memory stats unsupported")),
        _FakeDevice({}),
        _FakeDevice({"bytes_in_use": 5 * mib + mib // 2, "peak_bytes_in_use": 7 * mib}),
        _FakeDevice({"peak_bytes_in_use": 12 * mib}),  # no bytes_in_use counter
    ]
    assert metrics.device_memory_stats(devices) == {
        "memory/bytes_in_use_mib": 5.5,
        "memory/peak_bytes_in_use_mib": 12.0,
    }


def test_device_memory_stats_only_reported_counters():
    mib = 2**20
    assert metrics.device_memory_stats([_FakeDevice({"bytes_in_use": 2 * mib})]) == {
        "memory/bytes_in_use_mib": 2.0}
    no_stats = [_FakeDevice(None), _FakeDevice(ValueError("no")), _FakeDevice({})]
    assert metrics.device_memory_stats(no_stats) == {}
    assert metrics.device_memory_stats([]) == {}


def test_device_memory_stats_defaults_to_local_devices(monkeypatch):
    mib = 2**20
    fake = [_FakeDevice({"bytes_in_use": mib, "peak_bytes_in_use": 4 * mib})]
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: fake)
    assert metrics.device_memory_stats() == {"memory/bytes_in_use_mib": 1.0,
                                             "memory/peak_bytes_in_use_mib": 4.0}


def test_default_console_keys():
    assert metrics.DEFAULT_CONSOLE_KEYS == (
        "objective/scores", "objective/kl", "objective/kl_coef", "ppo/loss/total",
        "time/rollout_s", "time/update_s")


def test_tensorboard_writer_loads_without_torch(tmp_path):
    """A fresh process writes TensorBoard events without importing torch (tensorboardX would
    import it, seconds of every launch), and torch is still importable afterwards."""
    import subprocess
    import sys
    code = f"""
import sys
from pjit_ppo import metrics
w = metrics.TensorBoardWriter({str(tmp_path)!r})
w.write(1, {{"a": 1.5}})
w.close()
print("torch" in sys.modules)
import torch
print(torch.ones(2).sum().item())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=dict(__import__("os").environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "2.0"]
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
