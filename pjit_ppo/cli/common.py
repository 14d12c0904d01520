"""What every entry point does: CPU malloc tuning, jax flags, quiet library logs, and
user errors as one line on stderr with a clear exit status."""
import contextlib
import logging as std_logging
import os
import sys

from absl import flags, logging

from pjit_ppo import distributed
from pjit_ppo.cli import cpu_malloc, flag_errors

# Process flags of every entry point (a multi-process run; none needed for one process).
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's coordination service (multi-process "
    "runs; on SLURM / MPI / TPU pods it is detected when omitted).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes of the run (default: 1, or detected).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index in [0, num_processes) (default: detected).")
_LOCAL_DEVICE_IDS = flags.DEFINE_string(
    "local_device_ids", None, "Comma-separated local accelerator ids this process drives "
    "(default: all, or one per process where the cluster environment says so).")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s", distributed.HEARTBEAT_TIMEOUT_S,
    "A process silent this long counts as dead; the others then exit with an error.")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout_s", distributed.INITIALIZATION_TIMEOUT_S,
    "How long processes wait for each other at start-up.")


def tune_cpu_malloc() -> None:
    """Re-exec once with glibc malloc tunables on CPU (before jax starts)."""
    cpu_malloc.reexec_with_tuned_malloc()


def no_extra_args(argv) -> None:
    if len(argv) > 1:
        flag_errors.fail(f"unexpected arguments: {' '.join(argv[1:])}; settings are flags "
                         f"(--config.a.b=v)", "usage")


def setup_jax(log_dir: str | None = None) -> None:
    """jax reads its --jax_* flags from absl; the distributed runtime starts when the
    process flags (or a SLURM / MPI environment) say so; library INFO logs stay off the
    console. log_dir: every process logs to LOG_DIR/process_<i>.log too.

    Call it first in `main`, before anything asks jax for devices.
    """
    import jax
    jax.config.config_with_absl()
    quiet_library_info_logs()
    start_distributed()
    if log_dir:
        distributed.log_to_file(log_dir)


def start_distributed() -> bool:
    """`distributed.initialize` from the process flags; a bad flag or a coordinator that
    cannot be reached is one line on stderr (exit 2 / 1). Returns whether it started."""
    try:
        options = distributed.DistributedOptions(
            coordinator_address=_COORDINATOR.value or None,
            num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
            local_device_ids=distributed.parse_device_ids(_LOCAL_DEVICE_IDS.value),
            heartbeat_timeout_s=_HEARTBEAT.value,
            initialization_timeout_s=_INIT_TIMEOUT.value)
        return distributed.initialize(options)
    except distributed.DistributedError as e:
        print(f"error: distributed: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # the runtime's own errors (unreachable coordinator, timeout)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        print(f"error: distributed: could not join the run at "
              f"{_COORDINATOR.value or 'the detected coordinator'}: {first}; check that every "
              f"process uses the same --coordinator_address and --num_processes and that "
              f"process 0 is running", file=sys.stderr)
        sys.exit(1)


#: Library warnings that describe what we asked for, never a problem: Orbax warns that a
#: checkpoint manager opened read-only (evaluation, export) is read-only.
EXPECTED_LIBRARY_WARNINGS = ("read_only=True", "directory is read only")


def quiet_library_info_logs(prefixes=("/orbax/", "/asyncio/", "/jax/_src/xla_bridge.py")
                            ) -> None:
    """Keeps the console for our progress lines and our error messages.

    Records from libraries that log every step of their work (Orbax, and asyncio on
    Orbax's behalf) and jax's backend probing (an INFO line about TPU backends on every
    machine without one) are dropped below WARNING; their warnings and errors still show,
    as one line each, without the tracebacks of their worker threads: a failure that
    matters reaches the user as our own one-line message (`user_errors`). Warnings
    that only restate what we asked for (EXPECTED_LIBRARY_WARNINGS) are dropped.
    """
    def keep(record):
        if not any(p in record.pathname for p in prefixes):
            return True
        if record.levelno < std_logging.WARNING:
            return False
        if any(n in str(record.msg) for n in EXPECTED_LIBRARY_WARNINGS):
            return False
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.msg, record.args = str(record.getMessage()).splitlines()[0][:300], ()
        return True
    logging.get_absl_logger().addFilter(keep)  # records logged through absl
    logging.get_absl_handler().python_handler.addFilter(keep)  # through std logging


@contextlib.contextmanager
def user_errors():
    """Turns the errors a user can cause into one line on stderr and an exit status:
    2 for an invalid config, 1 for a run that stopped (non-finite values, checkpoints)."""
    from pjit_ppo.errors import CheckpointError
    from pjit_ppo.config import ConfigError
    from pjit_ppo.errors import DataError
    from pjit_ppo.errors import NonFiniteError
    try:
        yield
    except ConfigError as e:
        print(f"error: invalid config: {e}", file=sys.stderr)
        sys.exit(2)
    except DataError as e:
        print(f"error: data: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteError as e:
        print(f"error: training stopped: {e}", file=sys.stderr)
        sys.exit(1)
    except CheckpointError as e:
        # A save fails in its cross-process sync when another process died: that is the
        # lost process's story, not the disk's.
        lost = distributed.peer_failure_message(e)
        if lost is not None:
            sys.stdout.flush()
            sys.stderr.write(f"\nerror: distributed: {lost}\n")
            sys.stderr.flush()
            os._exit(1)
        # Orbax's writer threads may still be failing in the background; leave at once,
        # with our message last, rather than through their teardown tracebacks.
        sys.stdout.flush()
        sys.stderr.write(f"\nerror: checkpoint: {e}\n")
        sys.stderr.flush()
        os._exit(1)
    except Exception as e:
        message = distributed.peer_failure_message(e)
        if message is None:
            raise
        # Leave at once: an orderly exit would wait for the lost process at the
        # runtime's shutdown barrier.
        sys.stdout.flush()
        sys.stderr.write(f"\nerror: distributed: {message}\n")
        sys.stderr.flush()
        os._exit(1)


@contextlib.contextmanager
def fresh_workdir_removed_if_refused(workdir: str):
    """A launch that is refused (exit status 2: a config or data error found while the run
    is being built) on a work directory that did not exist leaves none behind: what this
    launch created there (logs/, checkpoints/, and parent directories it made) is
    removed. An existing work directory is never touched (its logs record the refused
    launch)."""
    import shutil
    created = None  # the outermost directory of the path that does not exist yet
    path = os.path.abspath(workdir)
    while not os.path.exists(path):
        created, path = path, os.path.dirname(path)
    try:
        yield
    except SystemExit as e:
        if created and e.code == 2 and os.path.isdir(created) and not _has_run(workdir):
            shutil.rmtree(created, ignore_errors=True)  # every process: whoever is last
        raise


def _has_run(workdir: str) -> bool:
    """Whether a run already trained there (metrics or a checkpoint): its work is kept even
    when it stops with exit status 2 later (e.g. a reward function failing mid-run)."""
    checkpoints = os.path.join(workdir, "checkpoints")
    return (os.path.exists(os.path.join(workdir, "metrics.jsonl"))
            or (os.path.isdir(checkpoints) and bool(os.listdir(checkpoints))))


@contextlib.contextmanager
def config_errors():
    """A light `user_errors` for the pre-flight checks (`pjit_ppo.preflight`): an invalid
    config or path is one line on stderr and exit status 2, before the heavy imports
    (jax among them: nothing here imports it)."""
    from pjit_ppo.config import ConfigError
    try:
        yield
    except ConfigError as e:
        flag_errors.fail(str(e))
