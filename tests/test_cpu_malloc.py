"""Tuned glibc malloc for CPU runs: the decision, the merge, and the effect after re-exec."""
import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from pjit_ppo.cli import cpu_malloc

TUNED = cpu_malloc.merged_tunables(None)


def test_merged_tunables_adds_ours_and_keeps_the_users():
    assert sorted(TUNED.split(":")) == sorted(f"{k}={v}" for k, v in cpu_malloc.TUNABLES.items())
    merged = cpu_malloc.merged_tunables("glibc.malloc.arena_max=4:glibc.cpu.x86_avx=0")
    items = merged.split(":")
    assert "glibc.malloc.arena_max=4" in items and "glibc.malloc.arena_max=1" not in items
    assert "glibc.cpu.x86_avx=0" in items
    assert f"glibc.malloc.mmap_threshold={16 << 30}" in items
    assert cpu_malloc.merged_tunables(merged) == merged


@pytest.mark.parametrize("env, system, libc, accelerator, expected", [
    ({}, "Linux", "glibc", False, True),
    ({}, "Linux", "glibc", True, False),                       # GPU/TPU plugin installed
    ({"JAX_PLATFORMS": "cpu"}, "Linux", "glibc", True, True),  # ...but forced onto CPU
    ({"JAX_PLATFORMS": "cuda,cpu"}, "Linux", "glibc", False, False),
    ({"PJIT_PPO_MALLOC_TUNING": "1"}, "Linux", "glibc", True, True),
    ({"PJIT_PPO_MALLOC_TUNING": "0"}, "Linux", "glibc", False, False),
    ({"_PJIT_PPO_MALLOC_REEXECED": "1"}, "Linux", "glibc", False, False),  # no loops
    ({"GLIBC_TUNABLES": TUNED}, "Linux", "glibc", False, False),            # already in effect
    ({}, "Darwin", "", False, False),
    ({}, "Linux", "musl", False, False),
])
def test_should_tune(env, system, libc, accelerator, expected):
    assert cpu_malloc.should_tune(env, system=system, libc=libc,
                                   accelerator=accelerator) is expected


def test_should_tune_rejects_unknown_setting():
    with pytest.raises(ValueError, match="PJIT_PPO_MALLOC_TUNING"):
        cpu_malloc.should_tune({"PJIT_PPO_MALLOC_TUNING": "yes"}, system="Linux", libc="glibc")


_CHILD = textwrap.dedent("""
    import ctypes, json, os, resource, sys
    from pjit_ppo.cli import cpu_malloc
    cpu_malloc.reexec_with_tuned_malloc()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    n = 256 << 20  # far above glibc's default (dynamic, at most 32 MiB) mmap threshold

    def touch_and_free():
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        libc.free(ctypes.c_void_p(p))

    touch_and_free()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        touch_and_free()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3
    print(json.dumps({"argv": sys.argv[1:], "tunables": os.environ.get("GLIBC_TUNABLES"),
                      "faults_per_alloc": faults, "describe": cpu_malloc.describe()}))
""")


def _run_child(tmp_path, setting):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "_PJIT_PPO_MALLOC_REEXECED", "JAX_PLATFORMS")}
    env.update(PJIT_PPO_MALLOC_TUNING=setting,
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, str(script), "--flag", "a b"], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc tunables are Linux/glibc only")
def test_reexec_keeps_the_command_and_stops_page_faults(tmp_path):
    tuned = _run_child(tmp_path, "1")
    default = _run_child(tmp_path, "0")
    assert tuned["argv"] == default["argv"] == ["--flag", "a b"]
    assert tuned["tunables"] == TUNED and default["tunables"] is None
    assert tuned["describe"].startswith("tuned") and default["describe"].startswith("default")
    pages = (256 << 20) // 4096
    # Default glibc mmaps and unmaps the block, so every use faults its pages in again
    # (fewer with transparent huge pages); tuned, the block is reused from the heap.
    assert default["faults_per_alloc"] > pages / 1024
    assert tuned["faults_per_alloc"] < 0.01 * default["faults_per_alloc"]


def test_package_and_malloc_tuning_import_without_jax():
    """The entry points re-exec before jax starts: importing pjit_ppo (public names load
    lazily) and the tuning module must not import jax."""
    code = ("import sys, pjit_ppo; from pjit_ppo.cli import cpu_malloc; "
            "print('jax' in sys.modules); from pjit_ppo import RunConfig; "
            "print(RunConfig.__name__)")  # RunConfig: the earlier name of PPORunConfig
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "PPORunConfig"]
