"""Compiled programs on disk, keyed by what they are made from, so a launch that repeats a
program loads it without tracing it (opt-in: PJIT_PPO_PROGRAM_CACHE_DIR).

JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR) skips XLA's compile, but
its key is the lowered program: every launch still traces and lowers each program first.
For the tiny recipe's two PPO phases that is about 2.7 CPU-s per launch, more than half
of what compiling them at XLA's -O0 costs. This cache's key is computed before tracing,
from:

  - the source of the pjit_ppo package, and the versions of Python and of the libraries
    traced into the programs (`TRACED_LIBRARIES`);
  - XLA_FLAGS, jax's configuration values, the backend, every device of the run (id,
    kind, process) and this process's index;
  - the caller's `description` of everything its traced function closes over (the PPO
    phases: the PPOConfig, the ModelConfigs, the reward's `program_key`, the mesh);
  - the arguments' tree structure, shapes, dtypes and shardings.

A hit deserializes the executable (`jax.experimental.serialize_executable`): no tracing,
lowering or compiling. A miss has XLA compile the program, with JAX's persistent cache
set aside for that compile, and writes the entry: an executable that JAX's cache gives
back does not serialize whole (jax 0.10.2: the copy loses fused kernels and fails when
run). So the first launch with an empty program cache compiles each program in full
even when JAX's cache holds it. The cache never fails a run: an entry that cannot be
read is compiled again, one that cannot be written is skipped, each with a warning.
Entries are written atomically (a temporary file, then a rename), so concurrent launches
may share a directory.

The description is the caller's contract: anything the traced function reads that is not
in the code, the configuration it names, or the arguments' shapes must be in it.
`pjit_ppo.ppo.trainer.PPOTrainer` uses the cache only when it can describe its programs
(the default optimizer and a reward that has a `program_key`); a random model's init
(`pjit_ppo.loading`) is described by its ModelConfig and its parameters' shardings; the
steps of SFT, reward learning and DPO (`pjit_ppo.supervised`) by the stage's config,
ModelConfig and step count.

Tracing alone also costs: `jax.eval_shape` of a model's init traces the whole model.
`shapes` keeps such results (trees of jax.ShapeDtypeStruct) in the same directory, keyed
like a program minus the devices (shapes do not depend on them).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import sys
import tempfile
from typing import Any, Callable, List, Optional, Sequence

from absl import logging

#: The environment variable that names the cache directory ("" or unset: no cache).
ENV = "PJIT_PPO_PROGRAM_CACHE_DIR"
#: Bumped when the entry format changes.
FORMAT = 2
_SUFFIX = ".programs"


def directory() -> Optional[str]:
    """The cache directory, or None when the cache is off."""
    return os.environ.get(ENV) or None


@functools.lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """sha256 of every .py file of the pjit_ppo package (relative path and bytes)."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


#: The distributions whose code is traced into the programs (their versions are keyed).
TRACED_LIBRARIES = ("jax", "jaxlib", "dm-haiku", "optax", "numpy", "ml_dtypes")


@functools.lru_cache(maxsize=None)
def _library_versions() -> str:
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    return repr((sys.version, [(name, version(name)) for name in TRACED_LIBRARIES]))


def _platform() -> str:
    import jax
    backend = jax.devices()[0].client
    devices = [(d.id, d.process_index, d.platform, d.device_kind) for d in jax.devices()]
    return repr((os.environ.get("XLA_FLAGS", ""), backend.platform, backend.platform_version,
                 jax.process_index(), jax.process_count(), devices, _jax_config()))


def arguments(args) -> str:
    """The arguments' tree structure and each leaf's shape, dtype and sharding."""
    import jax
    leaves, tree = jax.tree_util.tree_flatten(args)

    def leaf(x):
        sharding = getattr(x, "sharding", None)
        spec = None
        if sharding is not None:
            mesh = getattr(sharding, "mesh", None)
            spec = (type(sharding).__name__, repr(getattr(sharding, "spec", None)),
                    None if mesh is None else (tuple(mesh.axis_names),
                                               tuple(mesh.devices.shape),
                                               tuple(d.id for d in mesh.devices.flat)),
                    getattr(sharding, "memory_kind", None))
        return (tuple(x.shape), str(x.dtype), spec)
    return repr((str(tree), [leaf(x) for x in leaves]))


def _jax_config() -> str:
    import jax
    return repr(sorted((k, repr(v)) for k, v in jax.config.values.items()))


def key(name: str, description: str, args) -> str:
    """The entry key (hex sha256) of program `name` made from `description` (a string
    naming everything the traced function closes over) for arguments `args` (a pytree of
    arrays or jax.ShapeDtypeStructs with shardings)."""
    parts = (FORMAT, name, description, code_fingerprint(), _library_versions(), _platform(),
             arguments(args))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class _CompileCounter:
    """Counts the programs JAX's persistent cache gave back (its cache-hit event)."""

    def __init__(self):
        self.hits = 0
        import jax
        jax.monitoring.register_event_listener(self)

    def __call__(self, event: str, **kwargs) -> None:
        del kwargs
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1


@functools.lru_cache(maxsize=None)
def _counter() -> _CompileCounter:
    return _CompileCounter()


def _path(entry_key: str) -> str:
    return os.path.join(directory(), entry_key + _SUFFIX)


def load(entry_key: str) -> Optional[List[Any]]:
    """The compiled programs stored under `entry_key` (jax.stages.Compiled, in the order
    they were stored), or None when `entry_key` is None, the cache is off, it holds no
    such entry, or the entry cannot be read (a warning then)."""
    if entry_key is None or directory() is None:
        return None
    path = _path(entry_key)
    try:
        with open(path, "rb") as f:
            stored = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a bad entry is compiled again, never fatal
        logging.warning("program cache: cannot read %s (%s: %s); compiling instead", path,
                        type(e).__name__, e)
        return None
    try:
        import jax
        from jax.experimental import serialize_executable
        by_id = {d.id: d for d in jax.devices()}
        programs = [serialize_executable.deserialize_and_load(
            blob, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
            for blob, in_tree, out_tree, device_ids in stored]
    except Exception as e:  # noqa: BLE001
        logging.warning("program cache: cannot load %s (%s: %s); compiling instead", path,
                        type(e).__name__, e)
        return None
    logging.info("program cache: loaded %s", path)
    return programs


def _device_ids(program) -> list:
    """The ids of the devices `program` (a jax.stages.Compiled) runs on, in its device
    assignment's order (what loading it again needs)."""
    return [d.id for d in program._executable._unloaded_executable.device_list]


def store(entry_key: str, programs: Sequence[Any]) -> bool:
    """Writes `programs` (jax.stages.Compiled) under `entry_key`; returns whether it did.
    Nothing is written when the cache is off; a failure to serialize or write is a
    warning."""
    if directory() is None:
        return False
    try:
        from jax.experimental import serialize_executable
        blob = pickle.dumps([(*serialize_executable.serialize(p), _device_ids(p))
                             for p in programs])
    except Exception as e:  # noqa: BLE001 - the run goes on without the entry
        logging.warning("program cache: cannot serialize %s (%s: %s)", entry_key,
                        type(e).__name__, e)
        return False
    return _write_atomically(_path(entry_key), blob)


def _write_atomically(path: str, blob: bytes) -> bool:
    """Writes `blob` to `path` through a temporary file in the same directory and a
    rename; returns whether it did (a failure is a warning)."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except Exception as e:  # noqa: BLE001 - the run goes on without the entry
        logging.warning("program cache: cannot write %s (%s: %s)", path, type(e).__name__, e)
        return False
    return True


@contextlib.contextmanager
def _xla_compiles():
    """JAX's persistent compilation cache off (neither read nor written) inside."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache
    enabled = jax.config.jax_enable_compilation_cache
    if not enabled:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def compile_and_store(entry_key: Optional[str], compile_fn: Callable[[], Sequence[Any]]
                      ) -> List[Any]:
    """`compile_fn()` (a list of jax.stages.Compiled), compiled by XLA with JAX's
    persistent cache set aside (what it gives back does not serialize whole: see the
    module docstring) and stored under `entry_key`. entry_key None or the cache off:
    `compile_fn()` alone, JAX's cache as usual."""
    if entry_key is None or directory() is None:
        return list(compile_fn())
    counter = _counter()
    hits = counter.hits
    with _xla_compiles():
        programs = list(compile_fn())
    if counter.hits == hits:  # a guard: a program from JAX's cache is never stored
        store(entry_key, programs)
    return programs


def compiled(name: str, description: str, jitted, *args):
    """`jitted.lower(*args).compile()` (jitted: a jax.jit-wrapped function), or the program
    an earlier launch stored under the same key (`key(name, description, args)`; the
    description must name everything `jitted` closes over, its out_shardings included).
    With the cache off: compiled as usual (JAX's persistent cache applies)."""
    entry_key = key(name, description, args) if directory() is not None else None
    stored = load(entry_key)
    if stored is not None:
        (program,) = stored
        return program
    (program,) = compile_and_store(entry_key, lambda: [jitted.lower(*args).compile()])
    return program


def shapes(name: str, description: str, make: Callable[[], Any]) -> Any:
    """`make()` (a pytree of jax.ShapeDtypeStruct without shardings, e.g. from
    jax.eval_shape), or the tree an earlier launch stored under (name, description, the
    code, library versions and jax's configuration). With the cache off: `make()`."""
    folder = directory()
    if folder is None:
        return make()
    parts = (FORMAT, name, description, code_fingerprint(), _library_versions(),
             _jax_config())
    path = os.path.join(folder, hashlib.sha256(repr(parts).encode()).hexdigest() + ".shapes")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - traced again, never fatal
        logging.warning("program cache: cannot read %s (%s: %s); tracing instead", path,
                        type(e).__name__, e)
    tree = make()
    _write_atomically(path, pickle.dumps(tree))
    return tree
