"""CPU tuning of the entry points: keep glibc malloc from handing XLA:CPU's large
buffers back to the kernel.

This is not part of the library's import path: only the entry points
(`pjit_ppo/cli/*`, `launch/*`, `benchmarks/*`) call it, first thing, explicitly.

XLA:CPU allocates each compiled program's temporary buffer (gigabytes for the
PPO update of the CPU benchmark shape) and every output with plain `malloc`.
glibc serves blocks above `mmap_threshold` (at most 32 MiB by default) with a
fresh `mmap` and `munmap`s them on free, so every call of a jitted phase touches
its buffers' pages for the first time again (hundreds of thousands of minor page
faults per update). With a high mmap threshold and trim threshold the freed
blocks stay in the heap and are reused by the next call with no faults
(measurements: docs/performance.md).

glibc reads `GLIBC_TUNABLES` only at process start, so the setting cannot be
made from inside a running interpreter (`mallopt` caps the threshold at 2 GiB,
below the update's buffer). Entry points therefore call
`reexec_with_tuned_malloc()` first thing: it replaces the process with the same
command line and the tunables added, once.

It applies only to CPU runs on Linux/glibc: it is skipped when `JAX_PLATFORMS`
names no `cpu` first or, with `JAX_PLATFORMS` unset, when a JAX accelerator
plugin is installed (an accelerator host's pinned transfer buffers are better
served by the default allocator). Set `PJIT_PPO_MALLOC_TUNING=0` to never
re-exec, `=1` to re-exec even then.
"""
from __future__ import annotations

import os
import pkgutil
import platform
import sys
from typing import Mapping, MutableMapping

#: glibc tunables set for CPU runs: one arena (XLA's worker threads would
#: otherwise each warm their own), every block below 16 GiB from the heap, and
#: no trimming of the heap top below 64 GiB of free space.
TUNABLES = {
    "glibc.malloc.arena_max": "1",
    "glibc.malloc.mmap_threshold": str(16 << 30),
    "glibc.malloc.trim_threshold": str(64 << 30),
}
OPT_ENV = "PJIT_PPO_MALLOC_TUNING"
_DONE_ENV = "_PJIT_PPO_MALLOC_REEXECED"
_ACCELERATOR_PLUGIN_PREFIXES = ("jax_cuda", "jax_rocm", "libtpu", "jax_plugins")


def merged_tunables(existing: str | None) -> str:
    """`GLIBC_TUNABLES` with `TUNABLES` added; keys the user already set are kept.

    Args:
      existing: the current value (colon-separated `name=value`), or None.
    Returns:
      The merged colon-separated string.
    """
    items = [kv for kv in (existing or "").split(":") if kv]
    present = {kv.split("=", 1)[0] for kv in items}
    items += [f"{k}={v}" for k, v in TUNABLES.items() if k not in present]
    return ":".join(items)


def accelerator_plugin_installed() -> bool:
    """Whether a JAX GPU/TPU plugin package is importable (without importing jax)."""
    return any(m.name.startswith(_ACCELERATOR_PLUGIN_PREFIXES) for m in pkgutil.iter_modules())


def should_tune(env: Mapping[str, str], *, system: str | None = None,
                libc: str | None = None, accelerator: bool | None = None) -> bool:
    """Decide whether to re-exec with tuned malloc, from the environment.

    Args:
      env: the process environment.
      system, libc, accelerator: overrides for `platform.system()`,
        `platform.libc_ver()[0]` and `accelerator_plugin_installed()` (tests).
    Returns:
      True when the process should be replaced by a tuned one.
    """
    choice = env.get(OPT_ENV, "auto").strip().lower()
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"{OPT_ENV} must be 0, 1 or auto, got {env[OPT_ENV]!r}")
    if choice == "0" or env.get(_DONE_ENV) == "1":
        return False
    system = platform.system() if system is None else system
    libc = platform.libc_ver()[0] if libc is None else libc
    if system != "Linux" or libc != "glibc":
        return False
    if merged_tunables(env.get("GLIBC_TUNABLES")) == env.get("GLIBC_TUNABLES"):
        return False  # already in effect
    if choice == "1":
        return True
    platforms = env.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not (accelerator_plugin_installed() if accelerator is None else accelerator)


def tuned_environment(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with the tunables merged in and the re-exec marker set."""
    out = dict(env)
    out["GLIBC_TUNABLES"] = merged_tunables(env.get("GLIBC_TUNABLES"))
    out[_DONE_ENV] = "1"
    return out


def reexec_with_tuned_malloc(env: MutableMapping[str, str] | None = None) -> None:
    """Replace this process by the same command with tuned glibc malloc, if it applies.

    Call it before importing jax. Returns normally (doing nothing) when
    `should_tune` says no, when already re-executed, or for an interactive or
    stdin-fed interpreter, whose command cannot be replayed.
    """
    env = os.environ if env is None else env
    if sys.argv[0] in ("", "-") or not should_tune(env):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], tuned_environment(env))


def describe(env: Mapping[str, str] | None = None) -> str:
    """One line saying whether the tuned allocator is in effect (for benchmark output)."""
    env = os.environ if env is None else env
    current = env.get("GLIBC_TUNABLES")
    if current and merged_tunables(current) == current:
        return f"tuned (GLIBC_TUNABLES={current})"
    return f"default glibc malloc ({OPT_ENV}={env.get(OPT_ENV, 'auto')})"
