"""Running the entry points as a user does: real subprocesses, real files, real signals.

Subprocesses share the session's persistent JAX compilation cache (conftest.py), so
only the first run of a given program pays for compiling it.
"""
import json
import math
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
TINY = os.path.join(ROOT, "configs", "tiny_demo.py")


#: XLA flags of every test process (conftest.py) and entry-point subprocess. The suite
#: compiles hundreds of small programs and runs each for moments, so compiling them
#: cheaply matters more than running them fast:
#: - no LLVM optimisation of the generated CPU code (-19% wall time on the learning
#:   tests; the optimised HLO of the sampler's program was byte-identical with and
#:   without it, checked once);
#: - XLA:CPU's older elemental emitters for fusions instead of the MLIR fusion emitters:
#:   compiling the tiny PPO recipe's two phases took 3.8 CPU-s instead of 7.8, and
#:   test_transformer + test_lora + test_dpo 98 CPU-s instead of 182 (2026-12-06). The
#:   emitted loops differ, so results may differ in the last bits from a process
#:   without these flags; every comparison inside the suite runs under the same flags.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def env(devices: int = 1, **extra) -> dict:
    """The environment of an entry point subprocess: CPU, `devices` host devices, the test
    XLA flags, and the session's compilation cache and program cache (set by
    conftest.py)."""
    out = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = list(TEST_XLA_FLAGS)
    if devices > 1:
        flags.insert(0, f"--xla_force_host_platform_device_count={devices}")
    out["XLA_FLAGS"] = " ".join(flags)
    out.update(extra)
    return out


def command(script: str, *args) -> list:
    return [sys.executable, os.path.join(LAUNCH, script), *map(str, args)]


def run(script: str, *args, devices: int = 1, cwd=None, timeout: int = 600, **kwargs):
    """Runs launch/<script> to completion; returns the CompletedProcess (text output)."""
    return subprocess.run(command(script, *args), cwd=cwd or ROOT, env=env(devices),
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def start(script: str, *args, devices: int = 1, log_path=None) -> subprocess.Popen:
    """Starts launch/<script>; stdout and stderr go to `log_path`."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen(command(script, *args), cwd=ROOT, env=env(devices), stdout=log,
                            stderr=subprocess.STDOUT, text=True)


#: One PPO epoch per iteration (the tiny recipe has four), for runs that check plumbing
#: rather than learning. Runs with the same devices and overrides compile the same
#: programs whatever their run length (the default LR schedule's length is an input of
#: the compiled update) and share the session's compilation cache: test_multihost's
#: one-process reference and test_planning's profiled run (4 devices) are one program.
ONE_EPOCH = ("--config.ppo.noptepochs=1",)


def train_args(workdir, *overrides, iterations: int = 12, every: int = 3):
    return (f"--config={TINY}", f"--workdir={workdir}", f"--config.num_iterations={iterations}",
            f"--config.checkpoint.every={every}", "--config.measure_peak=false", *overrides)


def strict_lines(path) -> list:
    """The records of a metrics.jsonl, parsed as strict JSON (NaN/Infinity rejected)."""
    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")
    with open(path) as f:
        return [json.loads(line, parse_constant=reject) for line in f]


def semantic(record: dict) -> dict:
    """A metrics record without the timing and throughput keys (they differ run to run)."""
    return {k: v for k, v in record.items()
            if not k.startswith(("time/", "throughput/", "memory/"))}


def assert_same_metrics(a_path, b_path) -> None:
    """Every line of two metrics.jsonl files equal, bit for bit, apart from timings."""
    a, b = strict_lines(a_path), strict_lines(b_path)
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b]
    for x, y in zip(a, b):
        x, y = semantic(x), semantic(y)
        assert x.keys() == y.keys(), (x.keys() ^ y.keys())
        for k in x:
            same = x[k] == y[k] or (isinstance(x[k], float) and math.isnan(x[k])
                                    and math.isnan(y[k]))
            assert same, f"iteration {x['iteration']}: {k} {x[k]!r} != {y[k]!r}"


def wait_for(predicate, timeout: float = 300, poll: float = 0.005, proc=None):
    """Polls `predicate()` until it is true; fails if `proc` exits first or on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before the condition")
        time.sleep(poll)
    raise AssertionError("timed out waiting")


def metric_lines(workdir) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.endswith("\n"))


def kill(proc: subprocess.Popen, sig=signal.SIGKILL) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout=300)
