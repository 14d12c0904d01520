"""Memory planner: what one PPO iteration needs per device, before anything is allocated.

`plan(config)` assembles the run on abstract shapes (`pjit_ppo.ppo.assembly` with a
`pjit_ppo.param_makers.Abstract` maker: the very assembly `pjit_ppo.ppo.run.build`
runs, on jax.ShapeDtypeStructs with the run's shardings; no parameter, optimizer state
or prompt is allocated), lowers and compiles the rollout and the update ahead of time,
and reads XLA's compiled memory analysis of each (per device: argument, output,
temporary, alias and generated-code bytes; `pjit_ppo.memory_analysis`). A phase's peak is

  peak = argument + output - alias + temp + generated code + resident elsewhere

where "resident elsewhere" counts every buffer that stays on the device during the
phase without being an argument of its program: the optimizer state through the
rollout (the rollout reads only the parameters), the frozen models through the update.
Beside XLA's figures, an analytic breakdown (`pjit_ppo.ppo.memory_plan`) says where the
bytes go. `largest_micro_batch` compiles a phase at several micro-batch sizes and
returns the largest that fits the device memory. The plan also counts the trainable and
total parameters and splits the resident bytes into the LoRA base, adapters, other
trained parameters, optimizer state and frozen models (`resident_breakdown_bytes`).

A running trainer's compiled programs give the same figures
(`pjit_ppo.ppo.memory_plan.trainer_plan`), which is what a training run logs at its start.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Dict, Optional, Sequence

import jax
import jax.numpy as jnp

from pjit_ppo import param_makers, sharding
from pjit_ppo.config import PPOConfig, RunConfig
from pjit_ppo.memory_analysis import (XLA_KEYS, device_bytes, gb, parse_bytes, phase_peak,
                                      to_json_ready, xla_figures)
from pjit_ppo.models import ModelConfig
from pjit_ppo.ppo.assembly import assemble
from pjit_ppo.ppo.memory_plan import PHASES, resident_elsewhere, trainer_plan
from pjit_ppo.ppo.trainer import PPOTrainer
from pjit_ppo.ppo.types import TrainState

__all__ = ["AbstractRun", "abstract_run", "plan", "micro_batch_candidates", "phase_peak_at",
           "largest_micro_batch", "to_text", "PHASES", "XLA_KEYS", "device_bytes", "gb",
           "parse_bytes", "to_json_ready", "trainer_plan"]


# ------------------------------------------------------------------ abstract run
@dataclasses.dataclass
class AbstractRun:
    """A run's trainer and its arguments as abstract values (nothing allocated)."""
    trainer: PPOTrainer
    state: TrainState       # ShapeDtypeStructs with shardings
    frozen: Dict[str, Any]  # {"ref", "reward"}, likewise
    query: jax.ShapeDtypeStruct
    query_mask: jax.ShapeDtypeStruct
    reward_model: Optional[ModelConfig]


def abstract_run(config: RunConfig, mesh, ppo: Optional[PPOConfig] = None) -> AbstractRun:
    """The trainer of `config` on `mesh` with abstract state, frozen models and prompts:
    `pjit_ppo.ppo.assembly.assemble`, the assembly the real build runs, with an
    abstract maker. `ppo` replaces config.ppo (the micro-batch search)."""
    if ppo is not None:
        config = dataclasses.replace(config, ppo=ppo)
    run = assemble(config, param_makers.Abstract(mesh))
    batch_sh = sharding.batch_sharding(mesh, 2)
    shape = (config.ppo.prompts_per_iteration, config.ppo.query_length)
    return AbstractRun(run.trainer, run.state, run.frozen,
                       jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sh),
                       jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=batch_sh),
                       run.reward_model)


def plan(config: RunConfig, device_memory: Optional[int] = None, mesh=None,
         search: bool = False) -> Dict[str, Any]:
    """Compiles the run's two phases on abstract shapes and returns the plan (a JSON-able
    dict: `devices`, `device_memory_bytes`, `fits`, `phases` = {"rollout", "update"}
    with per-device `argument_bytes`, `output_bytes`, `temp_bytes`, `alias_bytes`,
    `generated_code_bytes`, `peak_bytes` and the analytic `breakdown`).

    With `search` and a device memory, also `largest_micro_batch`: per phase, the
    largest micro-batch (ppo.gradient_accumulation_steps split for the update,
    ppo.rollout_micro_batch_size for the rollout) whose peak fits.
    """
    config.validate()
    mesh = mesh or sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    run = abstract_run(config, mesh)
    run.trainer.compile(run.state, run.frozen, run.query, run.query_mask)
    out = trainer_plan(run.trainer, run.state, run.frozen, device_memory)
    if search and device_memory is not None:
        out["largest_micro_batch"] = {
            p: largest_micro_batch(config, mesh, p, device_memory) for p in PHASES}
    return out


# ------------------------------------------------------------------ micro-batch search
def micro_batch_candidates(cfg: PPOConfig, phase: str, batch_devices: int) -> Sequence[int]:
    """Micro-batch sizes (episodes, global) a phase can use, largest first: divisors of
    the minibatch (update) or batch (rollout) that the batch devices divide."""
    total = cfg.minibatch_size if phase == "update" else cfg.batch_size
    return [m for m in range(total, 0, -1) if total % m == 0 and m % batch_devices == 0]


def _with_micro(cfg: PPOConfig, phase: str, micro: int) -> PPOConfig:
    if phase == "update":
        return dataclasses.replace(cfg, gradient_accumulation_steps=cfg.minibatch_size // micro)
    return dataclasses.replace(cfg, rollout_micro_batch_size=micro)


def phase_peak_at(config: RunConfig, mesh, phase: str, micro: int) -> Dict[str, Any]:
    """Compiles one phase with micro-batches of `micro` episodes: {peak_bytes, compile_s}."""
    run = abstract_run(config, mesh, _with_micro(config.ppo, phase, micro))
    t0 = time.perf_counter()
    compiled = run.trainer.lower(run.state, run.frozen, run.query, run.query_mask)[phase] \
        .compile()
    figures = xla_figures(compiled)
    peak = phase_peak(figures, resident_elsewhere(phase, run.state, run.frozen,
                                                  run.trainer.models))
    return {"micro_batch": micro, "peak_bytes": peak,
            "compile_seconds": time.perf_counter() - t0}


def largest_micro_batch(config: RunConfig, mesh, phase: str, device_memory: int
                        ) -> Dict[str, Any]:
    """The largest micro-batch of `phase` whose peak fits `device_memory` (bisection
    over the candidates, the peak shrinking with the micro-batch).

    Returns {"micro_batch": size or None (none fits), "tried": [{micro_batch,
    peak_bytes, compile_seconds}, ...]}.
    """
    batch_devices = math.prod(mesh.shape[a] for a in sharding.DEFAULT_AXIS_RULES["batch"]
                              if a in mesh.shape)
    cands = micro_batch_candidates(config.ppo, phase, batch_devices)
    tried = {}

    def fits(i):
        if cands[i] not in tried:
            tried[cands[i]] = phase_peak_at(config, mesh, phase, cands[i])
        return tried[cands[i]]["peak_bytes"] <= device_memory

    lo, hi = 0, len(cands) - 1  # find the first (largest) index that fits
    if not cands or not fits(hi):
        best = None
    else:
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        best = cands[lo]
    return {"micro_batch": best, "tried": [tried[m] for m in sorted(tried, reverse=True)]}


# ------------------------------------------------------------------ text
def to_text(result: Dict[str, Any]) -> str:
    """The plan as text readable at a glance."""
    lines = [f"devices: {result['devices']}  mesh: {result.get('mesh')}  device memory: "
             f"{gb(result['device_memory_bytes'])}",
             f"compile: {result.get('compile_seconds') or 0:.1f} s"]
    if "trainable_parameters" in result:
        lines.append(f"parameters: {result['trainable_parameters']:,} trainable of "
                     f"{result['total_parameters']:,}")
    for name, n in (result.get("resident_breakdown_bytes") or {}).items():
        lines.append(f"  resident {name:<18} {gb(n)}")
    for phase in PHASES:
        p = result["phases"][phase]
        lines.append(f"\n[{phase}] per device")
        for key in XLA_KEYS:
            lines.append(f"  {key:<22} {gb(p[key])}")
        for name, n in p["resident_elsewhere_bytes"].items():
            lines.append(f"  resident: {name:<12} {gb(n)}")
        lines.append(f"  {'peak_bytes':<22} {gb(p['peak_bytes'])}")
        b = p["breakdown"]
        lines.append("  breakdown (analytic):")
        for key in ("parameters", "gradients", "optimizer_state", "frozen_models"):
            for name, n in b[key].items():
                lines.append(f"    {key + '/' + name:<28} {gb(n)}")
        if b["kv_cache_bytes"]:
            lines.append(f"    {'kv_cache':<28} {gb(b['kv_cache_bytes'])}")
        lines.append(f"    {'activations (estimate)':<28} {gb(b['activations_estimate_bytes'])}")
    if result["fits"] is not None:
        verdict = "FITS" if result["fits"] else "DOES NOT FIT"
        lines.append(f"\n{verdict}: peak {gb(result['peak_bytes'])} vs device memory "
                     f"{gb(result['device_memory_bytes'])}")
    for phase, found in (result.get("largest_micro_batch") or {}).items():
        tried = ", ".join(f"{t['micro_batch']}: {t['peak_bytes'] / 2**30:.2f} GiB"
                          for t in found["tried"])
        lines.append(f"largest {phase} micro-batch that fits: {found['micro_batch']} "
                     f"(tried {tried})")
    return "\n".join(lines)
