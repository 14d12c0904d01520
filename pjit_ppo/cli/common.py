"""What every entry point does: CPU malloc tuning, jax flags, quiet library logs, and
user errors as one line on stderr with a clear exit status."""
import contextlib
import logging as std_logging
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


def quiet_library_info_logs(prefixes=("/orbax/",)) -> None:
    """Keeps the console for our progress lines: INFO records from libraries that log
    every step of their work (Orbax) are dropped; their warnings and errors still show."""
    def keep(record):
        return record.levelno >= std_logging.WARNING or not any(
            p in record.pathname for p in prefixes)
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
        print(f"error: checkpoint: {e}", file=sys.stderr)
        sys.exit(1)
