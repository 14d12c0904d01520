"""What every entry point does: CPU malloc tuning, jax flags, quiet library logs, and
user errors as one line on stderr with a clear exit status."""
import contextlib
import logging as std_logging
import os
import sys

from absl import app, logging

from pjit_ppo.cli import cpu_malloc


def tune_cpu_malloc() -> None:
    """Re-exec once with glibc malloc tunables on CPU (before jax starts)."""
    cpu_malloc.reexec_with_tuned_malloc()


def no_extra_args(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")


def setup_jax() -> None:
    """jax reads its --jax_* flags from absl; library INFO logs stay off the console."""
    import jax
    jax.config.config_with_absl()
    quiet_library_info_logs()


def quiet_library_info_logs(prefixes=("/orbax/", "/asyncio/")) -> None:
    """Keeps the console for our progress lines and our error messages.

    Records from libraries that log every step of their work (Orbax, and asyncio on
    Orbax's behalf) are dropped below WARNING; their warnings and errors still show,
    as one line each, without the tracebacks of their worker threads: a failure that
    matters reaches the user as our own one-line message (`user_errors`).
    """
    def keep(record):
        if not any(p in record.pathname for p in prefixes):
            return True
        if record.levelno < std_logging.WARNING:
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
    from pjit_ppo.checkpoint import CheckpointError
    from pjit_ppo.config import ConfigError
    from pjit_ppo.ppo.trainer import NonFiniteError
    try:
        yield
    except ConfigError as e:
        print(f"error: invalid config: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteError as e:
        print(f"error: training stopped: {e}", file=sys.stderr)
        sys.exit(1)
    except CheckpointError as e:
        # Orbax's writer threads may still be failing in the background; leave at once,
        # with our message last, rather than through their teardown tracebacks.
        sys.stdout.flush()
        sys.stderr.write(f"\nerror: checkpoint: {e}\n")
        sys.stderr.flush()
        os._exit(1)
