"""Multi-process runs on JAX's distributed runtime (GPU pods, SLURM clusters, CPU tests).

One process per host (or per node) drives all its local devices; the processes find
each other through a coordinator (process 0) and see one global set of devices, so
the mesh, the compiled programs and the checkpoints are the same as in one process.

- `initialize(options)` starts the runtime before any backend exists: from explicit
  options (coordinator address, process count and id, local device ids), or, with
  none given, by JAX's cluster auto-detection when a multi-process environment
  (SLURM, Open MPI, TPU pods, Kubernetes) is present. A single process needs nothing.
  CPU processes use gloo for their cross-process collectives.
- Exactness on CPU (`initialize`): N processes compute bit for bit what one process
  with all N x d devices computes *on gloo*: `--num_processes=1` with a
  `--coordinator_address` starts the runtime in one process for that (gloo sums
  across devices in another order than XLA:CPU's in-process collectives, so a plain
  one-process run agrees only to float32 rounding), and CPU processes size XLA's
  thread pool for the run's global device count (`_size_cpu_thread_pool`).
- Failure handling: every process sends heartbeats to the coordination service; a
  process that dies is noticed after `heartbeat_timeout_s` and the others stop with
  an error instead of waiting forever in a collective.
- `is_chief`, `barrier`, `broadcast_from_chief`: process-0 helpers for the few things
  only one process may do (writing shared files, renaming directories).
- `log_to_file(directory)`: every process writes its own log file,
  DIR/process_<i>.log; processes other than 0 log only warnings to the console.
"""
from __future__ import annotations

import dataclasses
import logging as std_logging
import os
import re
from typing import Any, Optional, Tuple

#: Defaults of the failure-detection timeouts (seconds). A dead peer usually breaks the
#: collective the others are in at once; otherwise the heartbeats stop the survivors
#: within about a minute. Heartbeats come from a thread of their own, so compiling or
#: writing a checkpoint does not miss them, but a host overloaded for tens of seconds
#: (measured: 30 s was too short on a 2-core test machine running many compiles) can:
#: raise --heartbeat_timeout_s there (JAX's own default is 100).
HEARTBEAT_TIMEOUT_S = 60
INITIALIZATION_TIMEOUT_S = 300
SHUTDOWN_TIMEOUT_S = 60


class DistributedError(RuntimeError):
    """The distributed runtime cannot start with the given options; says which flag to fix."""


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
    """How this process joins a multi-process run (all None: single process or auto-detect).

    coordinator_address: "host:port" of process 0's coordination service.
    num_processes: the number of processes of the run (1: start the runtime only with
      a coordinator_address: a one-process run on gloo, see `initialize`).
    process_id: this process's index in [0, num_processes).
    local_device_ids: the local accelerators this process drives (None: all of them,
      or what the cluster environment says).
    heartbeat_timeout_s: a process missing heartbeats this long counts as dead; the
      others then exit with an error.
    initialization_timeout_s: how long processes wait for each other at start-up.
    shutdown_timeout_s: how long the processes wait for each other at exit.
    """
    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    local_device_ids: Optional[Tuple[int, ...]] = None
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S
    initialization_timeout_s: int = INITIALIZATION_TIMEOUT_S
    shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S

    @property
    def explicit(self) -> bool:
        """Whether any of the process flags was given."""
        return any(v is not None for v in (self.coordinator_address, self.num_processes,
                                           self.process_id))

    def check(self) -> "DistributedOptions":
        """Raises DistributedError for an inconsistent set of flags; returns self."""
        if self.num_processes is not None and self.num_processes < 1:
            raise DistributedError(f"--num_processes={self.num_processes} must be >= 1")
        if self.num_processes == 1 and self.process_id not in (None, 0):
            raise DistributedError(f"--process_id={self.process_id} with --num_processes=1: "
                                   f"the only process is 0")
        if (self.num_processes or 1) > 1:
            missing = [f"--{name}" for name in ("coordinator_address", "process_id")
                       if getattr(self, name) is None]
            if missing and not detected_cluster():
                raise DistributedError(
                    f"--num_processes={self.num_processes} needs {' and '.join(missing)} "
                    f"(no SLURM / MPI / TPU environment to take them from)")
        if self.process_id is not None and self.num_processes is not None and not (
                0 <= self.process_id < self.num_processes):
            raise DistributedError(f"--process_id={self.process_id} must be in "
                                   f"[0, --num_processes={self.num_processes})")
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            raise DistributedError(f"--coordinator_address={self.coordinator_address!r} must "
                                   f"be host:port (e.g. 10.0.0.1:1234)")
        for name in ("heartbeat_timeout_s", "initialization_timeout_s", "shutdown_timeout_s"):
            if getattr(self, name) < 1:
                raise DistributedError(f"{name}={getattr(self, name)} must be >= 1 second")
        return self


def parse_device_ids(text: Optional[str]) -> Optional[Tuple[int, ...]]:
    """"0,1,2,3" -> (0, 1, 2, 3); "" or None -> None. Raises DistributedError otherwise."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise DistributedError(f"--local_device_ids={text!r} must be comma-separated "
                               f"integers, e.g. 0,1,2,3") from None


def detected_cluster() -> Optional[str]:
    """The name of the multi-process environment JAX would detect (SLURM, Open MPI, TPU,
    Kubernetes) when it reports more than one process; None otherwise.

    A single-task allocation (e.g. an interactive `salloc` shell) is not a multi-process
    run, so it starts no runtime.
    """
    try:
        from jax._src import clusters
        kinds = [k for k in clusters.ClusterEnv._cluster_types if not k.opt_in_only_method]
    except (ImportError, AttributeError):  # the detection API moved: use SLURM's variables
        return "slurm" if int(os.environ.get("SLURM_NTASKS", "1")) > 1 else None
    for kind in kinds:
        try:
            if kind.is_env_present() and int(kind.get_process_count()) > 1:
                return kind.__name__
        except Exception:  # a half-configured environment: not one we can use
            continue
    return None


def _cpu_only() -> bool:
    import jax
    platforms = (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    import pkgutil  # an accelerator plugin installed: jax will not run on CPU alone
    prefixes = ("jax_cuda", "jax_rocm", "libtpu", "jax_plugins")
    return not any(m.name.startswith(prefixes) for m in pkgutil.iter_modules())


def initialize(options: DistributedOptions = DistributedOptions()) -> bool:
    """Starts JAX's distributed runtime if this is a multi-process run; returns whether it did.

    Call it before anything asks jax for devices. With explicit options (any of
    coordinator_address / num_processes / process_id) the missing ones come from the
    cluster environment; with none, the runtime starts only when a multi-process
    environment is detected (`detected_cluster`). num_processes=1 starts it only with
    a coordinator_address: one process on the runtime, the reference a multi-process
    CPU run equals bit for bit (both on gloo; without the runtime XLA:CPU's in-process
    all-reduce sums in device order, gloo in another, so they agree to rounding only).
    CPU-only runs select gloo cross-process collectives and size XLA's thread pool for
    the global device count (`_size_cpu_thread_pool`).

    Raises:
      DistributedError: inconsistent options, or the backend already started.
    """
    import jax
    options.check()
    if options.num_processes == 1 and options.coordinator_address is None:
        return False
    cluster = detected_cluster()
    if not options.explicit and cluster is None:
        return False
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise DistributedError("the JAX backend started before the distributed runtime: "
                               "call pjit_ppo.distributed.initialize first thing")
    if _cpu_only():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process_id = 0 if options.num_processes == 1 else options.process_id
    std_logging.getLogger("absl").info(
        "joining a multi-process run: coordinator %s, process %s of %s%s",
        options.coordinator_address or "(from the environment)",
        "auto" if process_id is None else process_id,
        "auto" if options.num_processes is None else options.num_processes,
        f" (detected {cluster})" if cluster and not options.explicit else "")
    jax.distributed.initialize(
        coordinator_address=options.coordinator_address,
        num_processes=options.num_processes,
        process_id=process_id,
        local_device_ids=list(options.local_device_ids) if options.local_device_ids else None,
        initialization_timeout=options.initialization_timeout_s,
        heartbeat_timeout_seconds=options.heartbeat_timeout_s,
        shutdown_timeout_seconds=options.shutdown_timeout_s)
    if _cpu_only():
        from jax._src import distributed as jax_distributed
        _size_cpu_thread_pool(jax_distributed.global_state.num_processes)
    return True


def _local_cpu_devices() -> int:
    """The number of CPU devices this process will have, read before the backend starts:
    jax_num_cpu_devices, else XLA_FLAGS' --xla_force_host_platform_device_count, else 1."""
    import jax
    n = jax.config.jax_num_cpu_devices
    if n is not None and n > 0:
        return int(n)
    counts = re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                        os.environ.get("XLA_FLAGS", ""))
    return int(counts[-1]) if counts else 1


def _size_cpu_thread_pool(num_processes: int) -> None:
    """Gives this CPU process the XLA thread pool one process with all the run's devices
    would have, so that every process compiles and runs the programs that one would.

    XLA:CPU sizes its pool max(PJRT_NPROC or NPROC, else the schedulable CPUs, local
    devices), and the pool size is part of the numerics: XLA partitions its parallel
    work by it (measured on 2 cores: the PPO update compiled for 2 x 4 devices had 4-way
    loop-fusion partitions where 1 x 8 had 8-way, and the updated parameters differed
    in the last bits; with equal pools the programs and the parameters are identical).
    So when the global device count exceeds the CPUs, PJRT_NPROC is set to it (the
    pool a one-process run would get); a PJRT_NPROC or NPROC the user set is kept.
    Needs to run before the backend starts (it reads the variable once).
    """
    if os.environ.get("PJRT_NPROC") or os.environ.get("NPROC"):
        return
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    devices = (num_processes or 1) * _local_cpu_devices()
    if devices > cpus:
        os.environ["PJRT_NPROC"] = str(devices)


# ------------------------------------------------------------------ process-0 helpers
def process_index() -> int:
    import jax
    return jax.process_index()


def process_count() -> int:
    import jax
    return jax.process_count()


def is_chief() -> bool:
    """Whether this is process 0 (the one that writes shared files and logs)."""
    return process_index() == 0


#: How long a process waits for the others at a barrier or for process 0's verdict
#: (process 0 may be verifying large checkpoints, another process still compiling).
WAIT_TIMEOUT_S = 3600
_calls = {"n": 0}


def _client():
    """The coordination-service client of this process (None in a single process)."""
    import jax
    if process_count() == 1 or not jax.distributed.is_initialized():
        return None
    from jax._src import distributed as jax_distributed
    return jax_distributed.global_state.client


def _key(name: str) -> str:
    # Every process makes the same calls in the same order, so the n-th call has the
    # same key everywhere.
    _calls["n"] += 1
    return f"pjit_ppo/{name}/{_calls['n']}"


def barrier(name: str, timeout_s: int = WAIT_TIMEOUT_S) -> None:
    """Blocks until every process reaches the barrier `name` (no-op in one process).

    Goes through the coordination service, not through device collectives: CPU
    collectives (gloo) give up when a peer is more than 30 s late, which compiling or
    checkpoint verification on one process can exceed.
    """
    client = _client()
    if client is not None:
        client.wait_at_barrier(_key(name), timeout_in_ms=timeout_s * 1000)


def broadcast_from_chief(value: Any, name: str = "broadcast") -> Any:
    """Process 0's `value` (JSON-able) on every process, through the coordination service.

    Used where process 0 decided something from the file system (which checkpoint to
    resume from, whether a save fits on disk) that all processes must act on alike.
    """
    client = _client()
    if client is None:
        return value
    import json
    key = _key(name)
    if is_chief():
        client.key_value_set(key, json.dumps(value))
        return value
    return json.loads(client.blocking_key_value_get(key, WAIT_TIMEOUT_S * 1000))


def host_array(x):
    """The whole of a global jax.Array as a numpy array, on every process.

    Arrays that span processes are gathered with a collective (all processes must
    call this in the same order); for one process this is np.asarray. For small
    results (evaluation samples), never for training state.
    """
    import jax
    import numpy as np
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process (all processes must call it together).

    The stop decision after a SIGTERM that reached only some processes: every process
    then stops after the same iteration and joins the same checkpoint save.
    """
    client = _client()
    if client is None:
        return bool(flag)
    key, mine = _key("any"), process_index()
    client.key_value_set(f"{key}/{mine}", "1" if flag else "0")
    flags = [client.blocking_key_value_get(f"{key}/{i}", WAIT_TIMEOUT_S * 1000)
             for i in range(process_count())]  # all of them: see below
    out = "1" in flags
    # Every process has set this call's key, so every process has finished reading the
    # previous call's keys: this process's one can go (no key per iteration is kept).
    previous, _calls["any"] = _calls.get("any"), key
    if previous is not None:
        client.key_value_delete(f"{previous}/{mine}")
    return out


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` is a runtime error saying a peer is gone (gloo's broken connections,
    the coordination service's barriers and heartbeats), not e.g. an out-of-memory error."""
    import jax
    markers = ("gloo", "connection", "peer", "unavailable", "deadline_exceeded", "barrier",
               "heartbeat", "task")
    runtime_error = getattr(jax.errors, "JaxRuntimeError", RuntimeError)
    seen = set()
    while error is not None and id(error) not in seen:  # Orbax wraps the runtime's error
        seen.add(id(error))
        text = str(error).lower()
        if "gloo" in text or (isinstance(error, runtime_error)
                              and any(m in text for m in markers)):
            return True
        error = error.__cause__ or error.__context__
    return False


def peer_failure_message(error: BaseException) -> Optional[str]:
    """What to tell the user when a multi-process run fails in the runtime (a collective
    or a barrier with a process that died); None for other errors and single processes."""
    import jax
    if not jax.distributed.is_initialized() or process_count() == 1:
        return None
    if not is_peer_failure(error):
        return None
    while isinstance(error.__cause__, BaseException):
        error = error.__cause__  # the runtime's own words, not a wrapper's
    text = str(error).strip()
    first = text.splitlines()[0][:300] if text else type(error).__name__
    return (f"process {process_index()} lost contact with the other processes of the run "
            f"({first}); another process probably stopped: see its log "
            f"(WORKDIR/logs/process_<i>.log). Restart all processes with the same command "
            f"to resume from the latest checkpoint")


# ------------------------------------------------------------------ logs
def log_to_file(directory: str) -> str:
    """Every process logs to DIR/process_<i>.log (appending); returns the path.

    Processes other than 0 keep only warnings and errors on the console (so a run's
    console shows one copy of the progress), everything in their file.
    """
    from absl import logging
    index = process_index()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"process_{index}.log")
    root = std_logging.getLogger()
    if not any(getattr(h, "baseFilename", None) == os.path.abspath(path)
               for h in root.handlers):
        handler = std_logging.FileHandler(path)
        handler.setFormatter(std_logging.Formatter(
            f"%(asctime)s [process {index}] %(levelname)s %(filename)s:%(lineno)d] "
            f"%(message)s"))
        root.addHandler(handler)
    if index != 0:
        logging.get_absl_handler().python_handler.addFilter(
            lambda record: record.levelno >= std_logging.WARNING)
    import jax
    logging.info("process %d of %d: %d local devices of %d (%s)", index, process_count(),
                 jax.local_device_count(), jax.device_count(), jax.default_backend())
    return path
