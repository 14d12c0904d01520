"""Orbax checkpoints of a run over named pytrees: asynchronous saves, verified
completeness, restore onto any mesh. Every stage uses it; it knows no stage.

Layout of WORKDIR/checkpoints/<step>/ (one Orbax composite checkpoint):

  <name>/      one directory per item a stage saves: a pytree of arrays, as sharded
               (PPO: policy/ rest/ opt_state/ train/, see pjit_ppo/ppo/state_io.py;
               SFT and reward learning: params/ opt_state/, see pjit_ppo/loop.py);
               each is restorable alone (evaluation and export read policy/ only)
  run/         JSON: what the stage needs besides arrays to continue (the resolved
               config, data positions, the loop's counters, where frozen models come
               from: they are rebuilt, never copied into checkpoints)
  pjit_ppo_manifest.json
               written after Orbax has committed the checkpoint: every file with its size
               and CRC-32. A checkpoint without it, or whose files do not match it, is
               incomplete or corrupt: it is skipped with a warning and never loaded.

Multi-process runs: every process writes the shards it holds (Orbax); the manifest,
the space reservation, and setting corrupt checkpoints aside are done by process 0 alone,
and its verdicts (which checkpoint is complete, whether a save fits) are broadcast so
that all processes act alike. A checkpoint restores in any number of processes.

Restores take an abstract target (shapes, dtypes and the *target* shardings), so a
checkpoint saved on one mesh is read directly into another: nothing is first
materialised in the saved layout.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import re
import zlib
from typing import Any, Dict, List, Mapping, Optional, Tuple

import jax
import orbax.checkpoint as ocp
from absl import logging

from pjit_ppo import distributed
from pjit_ppo.errors import CheckpointError
from pjit_ppo.config import CheckpointOptions

MANIFEST = "pjit_ppo_manifest.json"
#: The item holding the run's JSON; no array item may take its name.
RUN_ITEM = "run"
#: Files Orbax itself rewrites after the manifest is made (step metadata, commit marker):
#: not covered by it.
_UNLISTED = (MANIFEST, "_CHECKPOINT_METADATA", "commit_success.txt")
FORMAT_VERSION = 1
_CHUNK = 16 << 20


def checkpoint_dir(workdir: str) -> str:
    """WORKDIR/checkpoints as an absolute path."""
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def file_manifest(step_dir: str) -> Dict[str, List[int]]:
    """{relative path: [size, crc32]} of every file under `step_dir` except the manifest."""
    out = {}
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, step_dir)
            if rel not in _UNLISTED:
                out[rel] = [os.path.getsize(path), _crc32(path)]
    return out


def verify(step_dir: str) -> Optional[str]:
    """None if the checkpoint in `step_dir` is complete and intact, else what is wrong."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        return "it has no manifest (its save did not finish)"
    try:
        with open(path) as f:
            want = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"its manifest is unreadable ({e})"
    have = file_manifest(step_dir)
    missing = sorted(set(want) - set(have))
    if missing:
        return f"file {missing[0]} is missing"
    for rel, (size, crc) in sorted(want.items()):
        if have[rel][0] != size:
            return f"file {rel} has {have[rel][0]} bytes, {size} were written"
        if have[rel][1] != crc:
            return f"file {rel} does not match its checksum"
    return None


def _abstract(tree):
    """ShapeDtypeStructs with the shardings of `tree` (arrays or ShapeDtypeStructs)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def _has_arrays(tree) -> bool:
    return bool(jax.tree.leaves(tree))


def _check_names(items: Mapping[str, Any]) -> None:
    for name in items:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name == RUN_ITEM:
            raise ValueError(f"checkpoint item name {name!r}: use an identifier other than "
                             f"{RUN_ITEM!r}")


class RunCheckpointer:
    """Saves and restores the named pytrees (items) of one run directory.

    Args:
      workdir: the run directory; checkpoints go to WORKDIR/checkpoints/<step>/.
      options: the config's `checkpoint` section (every, keep, keep_period, async_save).
      read_only: open existing checkpoints only (evaluation, export).
    Raises:
      CheckpointError: the directory cannot be created or written.
    """

    def __init__(self, workdir: str, options: CheckpointOptions = CheckpointOptions(),
                 read_only: bool = False):
        self.directory = checkpoint_dir(workdir)
        self.options = options
        self._pending: Optional[int] = None
        self._saved_once = False
        if read_only:
            if not os.path.isdir(self.directory):
                raise CheckpointError(f"no checkpoints in {os.path.abspath(workdir)} (expected "
                                      f"{self.directory}/<step>/)")
        else:
            self._check_writable()
        self._warn_incomplete()
        asynchronous = options.async_save and not read_only
        manager_options = ocp.CheckpointManagerOptions(
            max_to_keep=options.keep, keep_period=options.keep_period or None,
            enable_async_checkpointing=asynchronous, create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._on_committed)
            if asynchronous else None)
        self._manager = ocp.CheckpointManager(self.directory, options=manager_options)

    # ------------------------------------------------------------ directory checks
    def _check_writable(self) -> None:
        probe = os.path.join(self.directory, f".write_probe_{distributed.process_index()}")
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise CheckpointError(
                f"cannot write checkpoints to {self.directory}: {e.strerror or e}; choose a "
                f"writable --workdir (or free space on its disk)") from None

    def _reserve(self, step: int, nbytes: int) -> None:
        """Checks, before Orbax writes anything, that `nbytes` fit in the directory.

        Allocates (posix_fallocate) and removes a file of that size, so a full disk or
        a file-size limit fails here with one clear message instead of inside Orbax's
        writer threads. Skipped where the filesystem cannot preallocate.
        """
        problem = self._reserve_here(step, nbytes) if distributed.is_chief() else None
        problem = distributed.broadcast_from_chief(problem)
        if problem is not None:
            raise CheckpointError(problem)

    def _reserve_here(self, step: int, nbytes: int) -> Optional[str]:
        probe = os.path.join(self.directory, f".space_probe_{step}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            finally:
                os.close(fd)
                os.remove(probe)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                return None
            return (f"saving checkpoint {step} to {self.directory} failed: "
                    f"{nbytes / 2**20:.1f} MiB do not fit there ({e.strerror or e}); free disk "
                    f"space or choose another --workdir (earlier checkpoints are untouched)")
        return None

    def _warn_incomplete(self) -> None:
        if not os.path.isdir(self.directory):
            return
        for name in sorted(os.listdir(self.directory)):
            if re.fullmatch(r"\d+\..*tmp.*", name):
                logging.warning("ignoring incomplete checkpoint %s (its save was interrupted)",
                                os.path.join(self.directory, name))

    # ------------------------------------------------------------ saving
    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _on_committed(self) -> None:
        """Writes the manifest of the pending save once all its files are written.

        Orbax calls this after its handlers have finalized every file and before it
        renames the temporary directory to WORKDIR/checkpoints/<step>/, so the manifest
        arrives with the same rename (synchronous saves call it on the final directory).
        Process 0 only: Orbax calls it there after every process has written its shards.
        """
        step, self._pending = self._pending, None
        if step is None or not distributed.is_chief():
            return
        step_dir = self._step_dir(step)
        if not os.path.isdir(step_dir):
            temporary = glob.glob(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*"))
            if len(temporary) != 1:
                raise CheckpointError(f"cannot find the directory being written for checkpoint "
                                      f"{step} in {self.directory}")
            step_dir = temporary[0]
        manifest = {"format": FORMAT_VERSION, "step": step, "files": file_manifest(step_dir)}
        tmp = os.path.join(step_dir, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f)
        os.replace(tmp, os.path.join(step_dir, MANIFEST))

    def save(self, step: int, items: Mapping[str, Any], run_info: Dict[str, Any]) -> None:
        """Saves `items` as checkpoint `step` (asynchronously if configured).

        items: {name: pytree of jax.Arrays} (any shapes, dtypes and shardings); each
        becomes WORKDIR/checkpoints/<step>/<name>/. An item without arrays (an empty
        dict) is not written, and comes back as its target on restore.
        run_info: JSON-able dict (resolved config, data positions, loop counters).
        The device arrays are copied to host memory before this returns, so the arrays
        may be donated to the next step right away. The first save of a run is
        waited for (errors show at once); later ones complete in the background.
        Raises CheckpointError when the save (or the previous asynchronous one) fails.
        """
        _check_names(items)
        args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()
                if _has_arrays(tree)}
        args[RUN_ITEM] = ocp.args.JsonSave({"format": FORMAT_VERSION, "step": step,
                                            **run_info})
        self.wait()  # the previous save, before a new one becomes pending
        first = not self._saved_once
        if first:
            self._reserve(step, sum(x.nbytes for x in jax.tree.leaves(dict(items))))
        try:
            self._pending = step
            self._manager.save(step, args=ocp.args.Composite(**args), force=True)
        except Exception as e:  # Orbax/tensorstore raise many types; the user needs one message
            raise CheckpointError(self._failure(step, e)) from e
        self._saved_once = True
        if first or not self.options.async_save:
            # The first save is waited for, so that a full disk or a bad directory shows
            # at once rather than after the next `every` steps.
            self.wait()

    def wait(self) -> None:
        """Blocks until the last save is committed and its manifest written."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise CheckpointError(self._failure(self._pending, e)) from e
        if self._pending is not None:  # a synchronous manager finished without the callback
            self._on_committed()
        # Process 0 may still have been writing the manifest (reading every file back):
        # the others wait here rather than in their next device collective.
        distributed.barrier("pjit_ppo_checkpoint_wait")

    def _failure(self, step, error: Exception) -> str:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (f"saving checkpoint {step} to {self.directory} failed: {reason[:300]}; check "
                f"free disk space and permissions there (earlier checkpoints are untouched)")

    def close(self) -> None:
        self.wait()
        self._manager.close()

    # ------------------------------------------------------------ finding and reading
    def steps(self) -> List[int]:
        """Committed checkpoint steps, ascending (verified or not)."""
        return sorted(self._manager.all_steps())

    def latest_complete(self, set_aside: bool = False) -> Optional[int]:
        """The newest checkpoint that verifies; newer ones that do not are named in a warning.

        set_aside: also rename each of those to WORKDIR/checkpoints/corrupt-<step>[-k] (kept
        for inspection, never deleted), so that the run can save that step again.
        """
        found = self._latest_complete_here(set_aside) if distributed.is_chief() else None
        found = distributed.broadcast_from_chief(found)
        if set_aside and distributed.process_count() > 1:
            distributed.barrier("pjit_ppo_checkpoints_set_aside")
            self._manager.reload()  # process 0 may have renamed some
        return found

    def _latest_complete_here(self, set_aside: bool) -> Optional[int]:
        for step in reversed(self.steps()):
            problem = verify(self._step_dir(step))
            if problem is None:
                return step
            logging.warning("skipping checkpoint %s: %s", self._step_dir(step), problem)
            if set_aside:
                self._set_aside(step)
        return None

    def _set_aside(self, step: int) -> None:
        target, k = os.path.join(self.directory, f"corrupt-{step}"), 1
        while os.path.exists(target):
            k += 1
            target = os.path.join(self.directory, f"corrupt-{step}-{k}")
        os.rename(self._step_dir(step), target)
        self._manager.reload()
        logging.warning("moved it to %s", target)

    def _checked(self, step: Optional[int]) -> int:
        if step is None:
            step = self.latest_complete()
            if step is None:
                raise CheckpointError(f"no complete checkpoint in {self.directory}")
            return step
        if step not in self.steps():
            raise CheckpointError(f"no checkpoint {step} in {self.directory}; there are: "
                                  f"{self.steps() or 'none'}")
        # Process 0 reads every file once; the others take its verdict.
        problem = verify(self._step_dir(step)) if distributed.is_chief() else None
        problem = distributed.broadcast_from_chief(problem)
        if problem is not None:
            raise CheckpointError(f"checkpoint {self._step_dir(step)} cannot be used: {problem}")
        return step

    def resolve(self, step: Optional[int]):
        """(step, run_info) of checkpoint `step`, or of the latest complete one when None."""
        step = self._checked(step)
        return step, self.run_info(step)

    def run_info(self, step: int) -> Dict[str, Any]:
        """The JSON saved with checkpoint `step` (config, prompt stream, frozen sources)."""
        step = self._checked(step)
        return self._manager.restore(step, args=ocp.args.Composite(
            run=ocp.args.JsonRestore()))["run"]

    def restore(self, step: int, targets: Mapping[str, Any]) -> Dict[str, Any]:
        """The items named in `targets` of checkpoint `step`, placed like their targets.

        targets: {name: pytree of arrays or ShapeDtypeStructs} whose shapes, dtypes and
        shardings say where the restored arrays go (any mesh; nothing is materialised
        in the saved layout). Items of the checkpoint not named are not read.
        Returns {name: pytree of jax.Arrays} (an empty target comes back as given).
        """
        return self._restore(self._checked(step), targets)

    def _restore(self, step: int, targets: Mapping[str, Any]) -> Dict[str, Any]:
        _check_names(targets)
        args = {name: ocp.args.StandardRestore(_abstract(tree))
                for name, tree in targets.items() if _has_arrays(tree)}
        out = self._manager.restore(step, args=ocp.args.Composite(**args)) if args else {}
        return {name: out[name] if name in args else tree for name, tree in targets.items()}

    def restore_item(self, step: Optional[int], name: str, target) -> Tuple[int, Any]:
        """One item of checkpoint `step` (the latest complete one if None), placed like
        `target` (nothing else is read). Returns (step, pytree of jax.Arrays)."""
        step = self._checked(step)
        return step, self._restore(step, {name: target})[name]

    def restore_policy(self, step: Optional[int], target) -> Tuple[int, Any]:
        """`restore_item(step, "policy", target)`: a PPO checkpoint's policy parameters
        (evaluation, export). Returns (step, params)."""
        return self.restore_item(step, "policy", target)
