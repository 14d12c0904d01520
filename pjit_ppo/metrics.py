"""Metric writers for the trainer: JSONL, TensorBoard and console.

Every writer checks ``jax.process_index()`` when it is built and is a no-op on
processes other than 0, so the trainer can call ``write`` everywhere in a
multi-process run and get one copy of each metric.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import time
from typing import Callable, Iterable, Mapping

import jax
import numpy as np
from absl import logging

# The metrics shown on the console line; the one definition the trainer uses.
DEFAULT_CONSOLE_KEYS = (
    "objective/scores",
    "objective/kl",
    "objective/kl_coef",
    "ppo/loss/total",
    "time/rollout_s",
    "time/update_s",
)


def _is_chief() -> bool:
    return jax.process_index() == 0


def _to_python(value):
    """Turns numpy/jax scalars (and 0-d or size-1 arrays) into int or float."""
    if isinstance(value, (bool, int, float)):
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"metric value must be a scalar, got shape {arr.shape}")
    item = arr.reshape(()).item()
    return item if isinstance(item, (bool, int)) else float(item)


def _json_value(value):
    """A metric value as strict JSON allows it: non-finite floats become None (null)."""
    value = _to_python(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricWriter:
    """Interface: ``write(step, scalars)`` once per iteration, then ``close()``."""

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """Records scalars (str -> python/numpy/jax scalar) for iteration step."""
        raise NotImplementedError

    def close(self) -> None:
        """Flushes and releases resources; later writes are not allowed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class JsonlWriter(MetricWriter):
    """Appends one JSON object ``{"iteration": step, **scalars}`` per write.

    The file is opened in append mode (a resumed run continues the same file)
    and flushed after each line, so a crash loses at most the line in flight.

    Every line is strict JSON (RFC 8259), readable by any parser: a value that
    is NaN, +inf or -inf (e.g. a diagnostic ratio that is 0/0 on some batch) is
    written as ``null``, and the key is kept, so "the metric was not finite"
    stays distinguishable from "the metric was not logged".
    """

    def __init__(self, path: str):
        self.path = path
        self._file = None
        if _is_chief():
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._file is None:
            return
        record = {"iteration": int(step)}
        record.update({k: _json_value(v) for k, v in scalars.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX imports torch whenever it is installed (1.5-3 s of every launch) only to
    accept torch tensors, which this library never passes; its import of torch is
    guarded, so hiding torch while it loads skips it. torch stays importable afterwards.
    """
    import sys
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardWriter(MetricWriter):
    """One tensorboardX ``add_scalar`` per key, with global_step = step.

    ``purge_step``: a resumed run passes the first step it will write; TensorBoard then
    drops events at or after it that an interrupted run had written, so the curves
    continue without duplicates.
    """

    def __init__(self, logdir: str, purge_step: int | None = None):
        self.logdir = logdir
        self._writer = None
        if _is_chief():
            self._writer = summary_writer_class()(logdir, purge_step=purge_step)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        for key, value in scalars.items():
            self._writer.add_scalar(key, float(_to_python(value)),
                                    global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return str(datetime.timedelta(seconds=int(round(seconds))))


def _format_value(value) -> str:
    value = _to_python(value)
    if isinstance(value, (bool, int)):
        return str(value)
    return f"{value:.4g}"


class ConsoleWriter(MetricWriter):
    """Logs one compact line per write.

    Example: ``iter 12/100 | elapsed 0:01:23 | ETA 0:10:09 | objective/scores
    0.1234 | ppo/lr 8.8e-06``.

    ``step`` is the number of iterations completed (the last is
    ``total_iterations``). The ETA is (total_iterations - step) times the mean
    iteration time since this writer was built, counting iterations from
    ``start_step`` (the step a resumed run starts from), so writing only every
    k-th iteration still gives the right rate. Keys absent from a write are
    skipped.
    """

    def __init__(self, total_iterations: int,
                 keys: Iterable[str] = DEFAULT_CONSOLE_KEYS,
                 start_step: int = 0,
                 print_fn: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.total_iterations = int(total_iterations)
        self.keys = tuple(keys)
        self.start_step = int(start_step)
        self._print = print_fn or (lambda line: logging.info("%s", line))
        self._clock = clock
        self._start_time = clock()
        self._active = _is_chief()

    def format_line(self, step: int, scalars: Mapping[str, float]) -> str:
        """The line ``write`` would log, without logging it."""
        elapsed = self._clock() - self._start_time
        done = int(step) - self.start_step
        if done > 0:
            eta = elapsed / done * max(self.total_iterations - int(step), 0)
        else:
            eta = float("nan")
        parts = [f"iter {int(step)}/{self.total_iterations}",
                 f"elapsed {_format_duration(elapsed)}",
                 f"ETA {_format_duration(eta)}"]
        parts += [f"{k} {_format_value(scalars[k])}"
                  for k in self.keys if k in scalars]
        return " | ".join(parts)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._active:
            self._print(self.format_line(step, scalars))


class MultiWriter(MetricWriter):
    """Forwards every write and close to each of a list of writers."""

    def __init__(self, writers: Iterable[MetricWriter]):
        self.writers = list(writers)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for writer in self.writers:
            writer.write(step, scalars)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def make_writers(workdir: str, total_iterations: int,
                 console_keys: Iterable[str] = DEFAULT_CONSOLE_KEYS,
                 tensorboard: bool = True, start_step: int = 0) -> MultiWriter:
    """Builds the trainer's writers.

    ``<workdir>/metrics.jsonl`` (JSONL), ``<workdir>/tensorboard/`` (event
    files, if tensorboard) and the console. All are no-ops off process 0.

    Args:
      workdir: run directory.
      total_iterations: number of iterations of the run, for the ETA.
      console_keys: metric names shown on the console line.
      tensorboard: whether to write TensorBoard event files.
      start_step: iterations already completed (a resumed run's checkpoint); the
        first write is start_step + 1.

    Returns:
      A MultiWriter over the writers.
    """
    writers = [JsonlWriter(os.path.join(workdir, "metrics.jsonl"))]
    if tensorboard:
        writers.append(TensorBoardWriter(os.path.join(workdir, "tensorboard"),
                                         purge_step=start_step + 1 if start_step else None))
    writers.append(ConsoleWriter(total_iterations, console_keys,
                                 start_step=start_step))
    return MultiWriter(writers)


class TraceWindow:
    """A jax.profiler trace of iterations start .. start + iterations - 1 (numbered as in
    metrics.jsonl, 1 = the first) into `directory`; start = 0: never traces.

    `before(n)` / `after(n)` bracket iteration n; `close()` ends an open trace (a run
    that stops inside the window still leaves a readable trace).
    """

    def __init__(self, start: int, iterations: int, directory: str):
        self.start, self.stop = int(start), int(start) + int(iterations)
        self.directory = directory
        self.active = False

    def before(self, iteration: int) -> None:
        if self.start and iteration == self.start and not self.active:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.active = True
            logging.info("profiling iterations %d..%d into %s", self.start, self.stop - 1,
                         self.directory)

    def after(self, iteration: int) -> None:
        if self.active and iteration >= self.stop - 1:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def device_memory_stats(devices: Iterable | None = None) -> dict[str, float]:
    """Maxima over devices of the backend's memory counters, in MiB.

    Args:
      devices: the devices to ask (anything with a ``memory_stats()`` method);
        None means ``jax.local_devices()``. A device whose ``memory_stats()``
        returns None or an empty dict, or raises (backends differ), is skipped.

    Returns:
      {"memory/bytes_in_use_mib": float, "memory/peak_bytes_in_use_mib":
      float}, each key only if some device reports the counter
      (``bytes_in_use`` / ``peak_bytes_in_use``); {} on backends without
      memory stats (CPU returns None).
    """
    if devices is None:
        devices = jax.local_devices()
    maxima: dict[str, float] = {}
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if not stats:
            continue
        for name in ("bytes_in_use", "peak_bytes_in_use"):
            if name in stats:
                key = f"memory/{name}_mib"
                mib = stats[name] / 2**20
                maxima[key] = max(maxima.get(key, 0.0), mib)
    return maxima


def truncate_jsonl(path: str, last_step: int) -> int:
    """Keeps the lines of a metrics.jsonl whose "iteration" is <= last_step.

    A resumed run calls this with its checkpoint's iteration, so the file holds one
    line per iteration as if the run had never stopped. The file is rewritten
    atomically; lines it drops (written after the checkpoint, or cut off by a crash)
    are appended to ``<path>.dropped`` rather than lost. Process 0 only.

    Returns:
      The number of lines dropped.
    """
    if not _is_chief() or not os.path.exists(path):
        return 0
    keep, drop = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                ok = int(json.loads(line)["iteration"]) <= last_step
            except (ValueError, KeyError, TypeError):
                ok = False
            (keep if ok else drop).append(line if line.endswith("\n") else line + "\n")
    if drop:
        with open(path + ".dropped", "a", encoding="utf-8") as f:
            f.writelines(drop)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    return len(drop)
