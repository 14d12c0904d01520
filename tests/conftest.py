"""Test setup: 8 fake CPU devices unless the caller set XLA_FLAGS already, a faster
compiler setting (runs.TEST_XLA_FLAGS), one compilation cache and one program cache for
the session."""
import os

import runs

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
for _flag in runs.TEST_XLA_FLAGS:
    if _flag.split("=")[0] not in _flags:
        _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _session_directory(variable: str, prefix: str) -> None:
    """Sets `variable` to a new temporary directory, removed at exit, unless the caller
    set it (xdist workers inherit the controller's)."""
    if variable not in os.environ:
        import atexit
        import shutil
        import tempfile
        path = tempfile.mkdtemp(prefix=prefix)
        os.environ[variable] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)


# One persistent compilation cache for the whole session, shared with the entry-point
# subprocesses (tests/runs.py): the same programs are compiled by many tests.
_session_directory("JAX_COMPILATION_CACHE_DIR", "pjit_ppo_jax_cache_")
# And one program cache (pjit_ppo.program_cache), for the tests and the subprocesses
# alike: a PPOTrainer that repeats another's phases, a supervised stage its steps and a
# random model its init, load them without tracing. Its key holds the source of pjit_ppo,
# not what a test patches at run time: a test that patches code one of those programs
# traces must `monkeypatch.delenv("PJIT_PPO_PROGRAM_CACHE_DIR")`.
_session_directory("PJIT_PPO_PROGRAM_CACHE_DIR", "pjit_ppo_programs_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """variant name (tiny_hf.VARIANTS) -> (checkpoint dir, transformers model), made once
    per test module."""
    import tiny_hf
    cache = {}

    def get(variant):
        if variant not in cache:
            family, overrides = tiny_hf.VARIANTS[variant]
            path = str(tmp_path_factory.mktemp(variant))
            cache[variant] = (path, tiny_hf.save_model(family, path, **overrides))
        return cache[variant]

    return get
