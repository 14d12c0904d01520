"""The supervised loop every non-RL stage shares (SFT, reward learning; DPO next).

A stage describes itself as a `Stage` (its compiled step, its training rows, held-out
evaluation, the metric keys it logs, work before the first and after the last step)
and calls `fit`, which does the rest the same way for every stage: batches in an epoch
shuffle that is a pure function of (seed, step), window means of the train metrics
every log_every steps, held-out metrics at step 0, every eval_every steps and at the
end, the non-finite guard, Orbax checkpoints (`Checkpoints`), exact resume, and
SIGTERM / SIGINT (finish the step, save, return).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import zlib
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import numpy as np
from absl import logging

from pjit_ppo import checkpoint, distributed, metrics as metrics_lib, supervised
from pjit_ppo.config import resume_conflicts
from pjit_ppo.errors import ConfigError, DataError, NonFiniteError

#: Config fields a resumed stage run may change: the layout, checkpointing, TensorBoard.
STAGE_RESUMABLE = ("mesh.", "checkpoint.", "tensorboard")

#: params -> (params, metric lines): work before step 1 (fresh runs) or after the last step.
Hook = Callable[[Any], Tuple[Any, List[Dict[str, float]]]]


# ---------------------------------------------------------------------------- batches
def shuffle_order(seed: int, epoch: int, n: int, tag: str) -> np.ndarray:
    """int64 [n]: the order of the n training rows in `epoch`, a permutation that depends
    only on (seed, tag, epoch); tag names the stage ("sft", "reward")."""
    tag_int = zlib.crc32(tag.encode()) & 0x7FFFFFFF
    return np.random.default_rng([seed, tag_int, epoch]).permutation(n)


class EpochOrder:
    """Which rows each step trains on: epoch e = step // steps_per_epoch visits the rows in
    `shuffle_order(seed, e, n, tag)`, step k of it takes rows [k * B, (k + 1) * B); the
    last n % B rows of an epoch are left out. A pure function of (seed, step), so a
    resumed run continues exactly."""

    def __init__(self, n: int, batch_size: int, seed: int, tag: str):
        if n < batch_size:
            raise ValueError(f"{n} rows cannot fill a batch of {batch_size}")
        self.n, self.batch_size, self.seed, self.tag = n, batch_size, seed, tag
        self.steps_per_epoch = n // batch_size
        self._epoch, self._order = -1, np.zeros(0, np.int64)

    def rows(self, step: int) -> np.ndarray:
        """int64 [batch_size]: the row indices of step `step` (0-based)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, shuffle_order(self.seed, epoch, self.n, self.tag)
        return self._order[k * self.batch_size:(k + 1) * self.batch_size]


def fingerprint(arrays: Mapping[str, np.ndarray]) -> str:
    """"<rows> rows, crc32 <hex>" of host arrays [rows, ...] (names in sorted order):
    recorded in checkpoints, so that a resume on other data is refused."""
    crc, rows = 0, 0
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        rows = len(a)
        crc = zlib.crc32(f"{name}{a.dtype.str}{a.shape}".encode(), crc)
        if a.size:
            crc = zlib.crc32(memoryview(a).cast("B"), crc)  # no copy of a large corpus
    return f"{rows} rows, crc32 {crc:08x}"


# ---------------------------------------------------------------------------- the stage
@dataclasses.dataclass
class Stage:
    """What a stage gives `fit`.

    name: for log lines ("SFT", "reward learning").
    mesh: the device mesh; train batches are split over its batch axes.
    step_fn: jitted (params, opt_state, batch) -> (params, opt_state, metrics), params
      and opt_state donated; batch: {name: [micro_batches, B / micro_batches, ...]}
      split on dim 1 (`supervised.make_train_step`); metrics: float32 scalars.
    train_arrays: {name: host array [N, ...]}, the training rows.
    batch_size, micro_batches: rows per step, and how many micro-batches they form.
    seed, shuffle_tag: the epoch shuffle (`EpochOrder`).
    total_steps: steps of the run (>= 1).
    train_metrics: ((logged key, step metric), ...): logged as means over the steps
      since the last train line, in this order, then "train/lr" and "time/step_s".
    lr: (0-based step, opt_state after it) -> the learning rate of that step.
    evaluate: params -> held-out metrics, written as one line.
    log_every, eval_every: train lines every log_every steps and at the end; held-out
      lines at step 0, every eval_every steps (0: never between) and at the end.
    console_keys: metric keys shown on the console.
    guarded: step metrics that must stay finite (NonFiniteError names them).
    fix: what the NonFiniteError tells the user to do.
    begin: before the step-0 evaluation of a fresh run (not of a resumed one).
    finish: after the last step's lines, before the final checkpoint.
    step_key: 0-based step -> a PRNG key passed to step_fn as a fourth argument (LoRA
      dropout); None: step_fn takes three.
    """

    name: str
    mesh: Any
    step_fn: Callable
    train_arrays: Mapping[str, np.ndarray]
    batch_size: int
    micro_batches: int
    seed: int
    shuffle_tag: str
    total_steps: int
    train_metrics: Sequence[Tuple[str, str]]
    lr: Callable[[int, Any], float]
    evaluate: Callable[[Any], Dict[str, float]]
    log_every: int
    eval_every: int
    console_keys: Sequence[str] = ()
    guarded: Sequence[str] = ("loss", "grad_norm")
    fix: str = "lower lr or set max_grad_norm"
    begin: Optional[Hook] = None
    finish: Optional[Hook] = None
    step_key: Optional[Callable[[int], Any]] = None


@dataclasses.dataclass
class Progress:
    """The loop's own state, saved as JSON with every checkpoint (exact resume).

    window: sums of the train metrics since the last train line; window_steps: how many.
    last_train / first_eval / last_eval: the last train line, the step-0 and the latest
    held-out lines. begun / finished: what the begin / finish hooks logged.
    """

    window: Dict[str, float] = dataclasses.field(default_factory=dict)
    window_steps: int = 0
    last_train: Dict[str, float] = dataclasses.field(default_factory=dict)
    first_eval: Dict[str, float] = dataclasses.field(default_factory=dict)
    last_eval: Dict[str, float] = dataclasses.field(default_factory=dict)
    begun: Dict[str, float] = dataclasses.field(default_factory=dict)
    finished: Dict[str, float] = dataclasses.field(default_factory=dict)


class FitResult(NamedTuple):
    """What `fit` returns: the final params and opt_state, the steps done (total_steps, or
    fewer when preempted), and the logged values (`Progress`)."""
    params: Any
    opt_state: Any
    steps: int
    preempted: bool
    progress: Progress


# ---------------------------------------------------------------------------- checkpoints
class Checkpoints:
    """A stage's checkpoints in WORKDIR/checkpoints/<step>/: params/, opt_state/ and run/
    (the resolved config, the data fingerprints and the loop's `Progress`).

    Opening them decides where the run starts (`start`: 0, or the newest complete
    checkpoint) and refuses, before anything is written, a resume whose config differs
    in a field outside `resumable` (ConfigError naming each field with both values) or
    whose data differ (DataError).

    Args:
      workdir: the stage's work directory.
      config: the stage config (`checkpoint` section, `to_dict()`).
      data: {name: fingerprint(...)} of the data the run trains and evaluates on.
      resumable: dotted-name prefixes that may differ on resume.
    """

    def __init__(self, workdir: str, config, data: Mapping[str, str],
                 resumable: Sequence[str] = STAGE_RESUMABLE):
        self.options = config.checkpoint
        self.checkpointer = checkpoint.RunCheckpointer(workdir, self.options)
        self.run_info = {"config": config.to_dict(), "data": dict(data)}
        self._resumable = tuple(resumable)
        self._defaults = type(config)().to_dict()
        self._saved: Dict[str, Any] = {}  # the run/ JSON of checkpoint `start`
        self.start = self._resume_point()
        self.saved_step = self.start

    def _resume_point(self) -> int:
        step = self.checkpointer.latest_complete(set_aside=True)
        if step is None:
            return 0
        where = self.checkpointer.directory
        if not self.options.resume:
            raise ConfigError(f"{where} holds checkpoint {step} and checkpoint.resume=False: "
                              f"use a new --workdir to start afresh (checkpoints are never "
                              f"overwritten)")
        saved = self._saved = self.checkpointer.run_info(step)
        conflicts = resume_conflicts(saved["config"], self.run_info["config"],
                                     resumable=self._resumable, defaults=self._defaults)
        if conflicts:
            listed = "; ".join(f"{name}: checkpoint {a!r}, now {b!r}"
                               for name, (a, b) in conflicts.items())
            raise ConfigError(f"cannot resume from checkpoint {step} in {where}: the config "
                              f"differs in {listed}. Use the checkpoint's values or a new "
                              f"--workdir")
        for name, now in self.run_info["data"].items():
            was = saved.get("data", {}).get(name)
            if was != now:
                raise DataError(f"cannot resume from checkpoint {step} in {where}: its {name} "
                                f"data were {was}, now {now}; restore the original files or "
                                f"use a new --workdir")
        return step

    def check_base(self, fingerprint: str) -> None:
        """Records the fingerprint of the frozen base weights LoRA adapters train on
        (`pjit_ppo.models.lora.fingerprint`) in every checkpoint; on a resume, refuses
        (ConfigError) a base other than the checkpoint's."""
        saved = self._saved.get("lora_base") if self.start else None
        if self.start and saved != fingerprint:
            raise ConfigError(
                f"cannot resume from checkpoint {self.start} in {self.checkpointer.directory}: "
                f"its LoRA adapters were trained on base weights with fingerprint {saved}, "
                f"these have {fingerprint}; point model.policy_path at the original base "
                f"model or use a new --workdir")
        self.run_info["lora_base"] = fingerprint

    def save(self, step: int, params, opt_state, progress: Progress) -> None:
        """Checkpoint `step` (asynchronous when checkpoint.async_save)."""
        self.checkpointer.save(step, {"params": params, "opt_state": opt_state},
                               {**self.run_info, "loop": dataclasses.asdict(progress)})
        self.saved_step = step

    def restore(self, params, opt_state) -> Tuple[Any, Any, Progress]:
        """(params, opt_state, Progress) of checkpoint `start`, placed like the given fresh
        params and opt_state (whose buffers are freed first)."""
        targets = {"params": params, "opt_state": opt_state}
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), targets)
        jax.tree.map(lambda x: x.delete(), targets)
        out = self.checkpointer.restore(self.start, abstract)
        progress = Progress(**self._saved["loop"])
        logging.info("resuming from checkpoint %d (%s)", self.start,
                     os.path.join(self.checkpointer.directory, str(self.start)))
        return out["params"], out["opt_state"], progress

    def wait(self) -> None:
        """Blocks until the last save is committed."""
        self.checkpointer.wait()


# ---------------------------------------------------------------------------- signals
class Preemption:
    """SIGTERM / SIGINT while training: the first asks the loop to stop after the current
    step (it saves a checkpoint and returns); a second one interrupts at once."""

    def __init__(self):
        self.signal: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.signal = signum
        logging.warning("received %s: finishing this step, then saving a checkpoint",
                        signal.Signals(signum).name)

    def agreed(self) -> bool:
        """Whether any process was signalled (all processes call it after each step, so
        they all stop after the same one)."""
        return distributed.any_process(self.signal is not None)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------- the loop
def _host_floats(metrics) -> Dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def _check_finite(stage: Stage, metrics: Dict[str, float], step: int) -> None:
    logged = {name: key for key, name in stage.train_metrics}
    for name in stage.guarded:
        if not np.isfinite(metrics[name]):
            raise NonFiniteError(f"{logged.get(name, name)} = {metrics[name]} at step {step}: "
                                 f"{stage.fix}")


def _add_to_window(stage: Stage, progress: Progress, metrics: Dict[str, float]) -> None:
    for key, name in stage.train_metrics:
        progress.window[key] = progress.window.get(key, 0.0) + metrics[name]
    progress.window_steps += 1


def _close_window(progress: Progress) -> Dict[str, float]:
    """The window's means (the next train line), and an empty window."""
    n = progress.window_steps
    line = {key: total / n for key, total in progress.window.items()}
    progress.window, progress.window_steps = {}, 0
    return line


def fit(stage: Stage, params, opt_state, *, workdir: str,
        checkpoints: Optional[Checkpoints] = None, tensorboard: bool = True) -> FitResult:
    """Trains `stage` for stage.total_steps steps from `checkpoints.start` (0: afresh).

    params, opt_state: the fresh state (pytrees of sharded jax.Arrays); on a resume they
    only give the placement of the restored one. Writes WORKDIR/metrics.jsonl and
    tensorboard/ (lines written after the restored checkpoint move to
    metrics.jsonl.dropped) and, with `checkpoints`, a checkpoint every
    checkpoint.every steps and one after `finish`. Stops early, after saving, on
    SIGTERM / SIGINT (`preempted`). Raises NonFiniteError when a guarded step metric
    is NaN or infinite.
    """
    total = stage.total_steps
    start = checkpoints.start if checkpoints is not None else 0
    progress = Progress()
    if start:
        params, opt_state, progress = checkpoints.restore(params, opt_state)
    # A fresh start drops everything (step-0 lines included) an unfinished run wrote.
    dropped = metrics_lib.truncate_jsonl(os.path.join(workdir, "metrics.jsonl"),
                                         start if start else -1)
    if dropped:
        logging.warning("metrics.jsonl: %d line(s) written after step %d moved to "
                        "metrics.jsonl.dropped", dropped, start)
    writer = metrics_lib.make_writers(workdir, total, console_keys=stage.console_keys,
                                      tensorboard=tensorboard, start_step=start)
    order = EpochOrder(len(next(iter(stage.train_arrays.values()))), stage.batch_size,
                       stage.seed, stage.shuffle_tag)
    micro = stage.batch_size // stage.micro_batches

    def batch(step):
        rows = order.rows(step)
        return supervised.put_batch(stage.mesh, {
            name: a[rows].reshape((stage.micro_batches, micro) + a.shape[1:])
            for name, a in stage.train_arrays.items()}, batch_dim=1)

    def hook(fn, step, into):
        new_params, lines = fn(params)
        for line in lines:
            writer.write(step, line)
            into.update(line)
        return new_params

    def evaluate(step):
        progress.last_eval = dict(stage.evaluate(params))
        writer.write(step, progress.last_eval)

    def save(step):
        if checkpoints is not None and checkpoints.saved_step != step:
            checkpoints.save(step, params, opt_state, progress)

    done, preempted = start, False
    try:
        with Preemption() as preemption:
            if start == 0:
                if stage.begin is not None:
                    params = hook(stage.begin, 0, progress.begun)
                evaluate(0)
                progress.first_eval = dict(progress.last_eval)
            t0, timed = time.perf_counter(), 0
            for step in range(start, total):
                keys = () if stage.step_key is None else (stage.step_key(step),)
                params, opt_state, metrics = stage.step_fn(params, opt_state, batch(step), *keys)
                metrics = _host_floats(metrics)
                done, timed = step + 1, timed + 1
                _check_finite(stage, metrics, done)
                _add_to_window(stage, progress, metrics)
                if done % stage.log_every == 0 or done == total:
                    line = _close_window(progress)
                    line["train/lr"] = float(stage.lr(step, opt_state))
                    line["time/step_s"] = (time.perf_counter() - t0) / timed
                    writer.write(done, line)
                    progress.last_train = line
                    t0, timed = time.perf_counter(), 0
                if done == total or (stage.eval_every and done % stage.eval_every == 0):
                    evaluate(done)
                if done == total:
                    if stage.finish is not None:
                        params = hook(stage.finish, done, progress.finished)
                    save(done)
                    break
                if checkpoints is not None and done % checkpoints.options.every == 0:
                    save(done)
                if preemption.agreed():
                    save(done)
                    preempted = True
                    break
            if checkpoints is not None:
                checkpoints.wait()
    except (ConfigError, DataError, NonFiniteError):
        # A stop the user must act on: the checkpoint still being written holds a state
        # from before the failing step, so it is finished (kept whole) before the error
        # leaves; the process would otherwise abandon it half-written.
        if checkpoints is not None:
            checkpoints.wait()
        raise
    finally:
        writer.close()
    if preempted:
        logging.warning("%s preempted at step %d, %s", stage.name, done,
                        f"saved checkpoint {done}" if checkpoints else "no checkpoints")
    return FitResult(params, opt_state, done, preempted, progress)
