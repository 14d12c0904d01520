"""What compiled programs hold in device memory: XLA's per-device memory analysis of a
compiled (SPMD) program, the bytes one device holds of (abstract) arrays, a phase's
peak, and sizes as text. Stage-neutral: a stage's memory plan (`pjit_ppo.ppo.memory_plan`)
and the planner (`pjit_ppo.planning`) are built on it.

A program's peak on one device is

  peak = argument + output - alias + temp + generated code + resident elsewhere

where "resident elsewhere" counts the buffers that stay on the device while the program
runs without being its arguments (e.g. PPO's optimizer state through the rollout).
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

#: XLA's figures per program, as keys of the planner's JSON output (per device, bytes).
XLA_KEYS = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
            "generated_code_bytes")

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'40GB' -> 40e9, '32GiB' -> 32 * 2**30, '1024' -> 1024 (bytes)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a memory size: use e.g. 40GB, 32GiB or a "
                         f"number of bytes")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


def gb(n: Optional[float]) -> str:
    """Bytes as 'x.xx GB (y.yy GiB)', or in MB / KB when smaller."""
    if n is None:
        return "n/a"
    for unit, bin_unit, scale in (("GB", "GiB", 3), ("MB", "MiB", 2), ("KB", "KiB", 1)):
        if abs(n) >= 10 ** (3 * scale) / 10 or scale == 1:
            return f"{n / 10 ** (3 * scale):.2f} {unit} ({n / 2 ** (10 * scale):.2f} {bin_unit})"
    return f"{n} B"


def _shard_bytes(x) -> int:
    """Bytes one device holds of an array or ShapeDtypeStruct (the largest shard)."""
    shape = tuple(x.shape)
    sh = getattr(x, "sharding", None)
    if sh is not None and shape:
        try:
            shape = sh.shard_shape(shape)
        except ValueError:  # uneven split: the largest shard is the ceiling
            spec = sh.spec
            shape = list(shape)
            for dim, axes in enumerate(spec):
                if axes is None:
                    continue
                axes = (axes,) if isinstance(axes, str) else axes
                n = math.prod(sh.mesh.shape[a] for a in axes)
                shape[dim] = -(-shape[dim] // n)
    return int(math.prod(shape)) * jnp.dtype(x.dtype).itemsize


def device_bytes(tree) -> int:
    """Per-device bytes of a pytree of (abstract) arrays with shardings."""
    return sum(_shard_bytes(x) for x in jax.tree.leaves(tree))


def xla_figures(compiled) -> Dict[str, int]:
    """XLA's per-device memory analysis of a compiled (SPMD) program, in bytes."""
    m = compiled.memory_analysis()
    return {"argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "alias_bytes": int(m.alias_size_in_bytes),
            "generated_code_bytes": int(m.generated_code_size_in_bytes)}


def phase_peak(figures: Dict[str, int], resident: Dict[str, int]) -> int:
    """argument + output - alias + temp + generated code + resident elsewhere."""
    return (figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"]
            + figures["temp_bytes"] + figures["generated_code_bytes"] + sum(resident.values()))


def phase_line(phase: str, p: Dict[str, Any], device_memory: Optional[int] = None) -> str:
    """One compact line per phase (what a training run logs)."""
    fits = "" if device_memory is None else (
        f" of {device_memory / 2**20:.1f} MiB: " + ("fits" if p["peak_bytes"] <= device_memory
                                                    else "DOES NOT FIT"))
    g = 2**20
    return (f"memory plan {phase}: peak {p['peak_bytes'] / g:.1f} MiB per device{fits} "
            f"(args {p['argument_bytes'] / g:.1f}, out {p['output_bytes'] / g:.1f}, "
            f"alias {p['alias_bytes'] / g:.1f}, temp {p['temp_bytes'] / g:.1f}, resident "
            f"elsewhere {sum(p['resident_elsewhere_bytes'].values()) / g:.1f} MiB)")


def to_json_ready(result: Dict[str, Any]) -> Dict[str, Any]:
    """numpy scalars -> Python numbers (json.dumps-safe)."""
    return jax.tree.map(lambda x: x.item() if isinstance(x, np.generic) else x, result)
