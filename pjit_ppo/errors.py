"""The errors a user can cause, one type each, shared by every stage.

Each message names what is wrong (the field, file, line or quantity), the value, and
the fix. The entry points print them as one line (`pjit_ppo/cli/common.py`): exit
status 2 for a config or data error, 1 for a run that stopped.
"""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field, the value and the fix."""


class DataError(ValueError):
    """Bad or missing data; the message names the file (and line or field) and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint or model file that cannot be written or read as it must be (a missing
    or mis-shaped tensor, a full disk, a failed save); the message names the path."""


class NonFiniteError(FloatingPointError):
    """A quantity training depends on became NaN or infinite; the message names it, the
    step, and the fix."""
