"""Memory planner: what one PPO iteration needs per device, before anything is allocated.

`plan(config)` builds the run's trainer on abstract shapes (jax.ShapeDtypeStruct with
the run's shardings: no parameter, optimizer state or prompt is allocated), lowers and
compiles the rollout and the update ahead of time, and reads XLA's compiled memory
analysis of each (per device: argument, output, temporary, alias and generated-code
bytes). A phase's peak is

  peak = argument + output - alias + temp + generated code + resident elsewhere

where "resident elsewhere" counts every buffer that stays on the device during the
phase without being an argument of its program: the optimizer state through the
rollout (the rollout reads only the parameters), the frozen models through the update.
Beside XLA's figures, an analytic breakdown (parameters, gradients and optimizer state
per trained model, frozen models, KV cache, activation estimate) says where the bytes
go. `largest_micro_batch` compiles a phase at several micro-batch sizes and returns
the largest that fits the device memory.

The same figures come from a running trainer's compiled programs (`trainer_plan`),
which is what a training run logs at its start.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from typing import Any, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pjit_ppo import sharding
from pjit_ppo.config import PPOConfig, RunConfig
from pjit_ppo.loading import lm_config
from pjit_ppo.models import ModelConfig, assemble, heads, init_params
from pjit_ppo.rewards import model_reward_fn, target_token_reward
from pjit_ppo.ppo.trainer import PPOTrainer
from pjit_ppo.ppo.types import PPOModels, TrainState

PHASES = ("rollout", "update")
#: XLA's figures per phase, as keys of the JSON output (per device, bytes).
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


# ------------------------------------------------------------------ per-device bytes
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


def _abstract(tree, mesh) -> Any:
    """ShapeDtypeStructs of `tree` (shapes) with the parameter shardings of `mesh`."""
    shardings = sharding.param_shardings(tree, mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        tree, shardings)


def _replicated(tree, mesh):
    rep = sharding.replicated(mesh)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), tree)


def _cast(tree, dtype):
    def one(s):
        d = dtype if jnp.issubdtype(s.dtype, jnp.floating) else s.dtype
        return jax.ShapeDtypeStruct(s.shape, d, sharding=s.sharding)
    return jax.tree.map(one, tree)


def _lm_config(config: RunConfig, path: str) -> ModelConfig:
    return lm_config(config.model, path)


def abstract_run(config: RunConfig, mesh, ppo: Optional[PPOConfig] = None) -> AbstractRun:
    """The trainer of `config` on `mesh` with abstract state, frozen models and prompts,
    assembled as `pjit_ppo.ppo.run.build` assembles the real ones (same trees, dtypes
    and shardings). `ppo` replaces config.ppo (the micro-batch search)."""
    ppo = ppo or config.ppo
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    policy_cfg = _lm_config(config, config.model.policy_path)
    policy = _abstract(jax.eval_shape(functools.partial(init_params, policy_cfg), key), mesh)
    compute = jnp.dtype(policy_cfg.compute_dtype)
    frozen: Dict[str, Any] = {"ref": _cast(policy, compute)}
    reward_cfg, reward = None, None
    if config.reward.kind == "model":
        reward_cfg = _lm_config(config, config.reward.path)
        trunk = _abstract(jax.eval_shape(functools.partial(init_params, reward_cfg), key), mesh)
        reward = assemble.trunk_only(trunk)
        reward.update(_replicated(jax.eval_shape(
            functools.partial(heads.init_reward_head, reward_cfg.d_model), key), mesh))
        frozen["reward"] = _cast(reward, jnp.dtype(reward_cfg.compute_dtype))
        reward_fn = model_reward_fn(reward_cfg)
    else:
        frozen["reward"] = None
        reward_fn = target_token_reward(tuple(config.reward.target_ids))
    if not ppo.uses_critic:
        params, critic_cfg = {"policy": policy}, None
    elif ppo.shared_trunk:
        head = jax.eval_shape(functools.partial(heads.init_value_head, policy_cfg.d_model))
        params = {"policy": policy, **_replicated(head, mesh)}
        critic_cfg = None
    else:
        source, critic_cfg = ((reward, reward_cfg) if ppo.critic_init == "reward"
                              else (policy, policy_cfg))
        critic = assemble.trunk_only(source)
        head = jax.eval_shape(functools.partial(heads.init_value_head, critic_cfg.d_model))
        critic.update(_replicated(head, mesh))
        params = {"policy": policy, "critic": critic}
    models = PPOModels(policy=policy_cfg, critic=critic_cfg, reward_fn=reward_fn)
    trainer = PPOTrainer(ppo, models, mesh, num_updates=config.num_updates,
                         reward_model=reward_cfg)
    state = abstract_state(trainer, params)
    batch_sh = sharding.batch_sharding(mesh, 2)
    shape = (ppo.prompts_per_iteration, ppo.query_length)
    return AbstractRun(trainer, state, frozen,
                       jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sh),
                       jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=batch_sh), reward_cfg)


def abstract_state(trainer: PPOTrainer, params) -> TrainState:
    """The TrainState `trainer.init_state(params)` would make, as ShapeDtypeStructs."""
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_shapes = jax.eval_shape(trainer.optimizer.init, params)
    opt_sh = sharding.opt_state_shardings(trainer.optimizer, param_sh, opt_shapes, trainer.mesh)
    opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                             opt_shapes, opt_sh)
    rep = sharding.replicated(trainer.mesh)
    return TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
                      jax.ShapeDtypeStruct((), jnp.int32, sharding=rep))


# ------------------------------------------------------------------ figures
def xla_figures(compiled) -> Dict[str, int]:
    """XLA's per-device memory analysis of a compiled (SPMD) program, in bytes."""
    m = compiled.memory_analysis()
    return {"argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "alias_bytes": int(m.alias_size_in_bytes),
            "generated_code_bytes": int(m.generated_code_size_in_bytes)}


def resident_elsewhere(phase: str, state: TrainState, frozen) -> Dict[str, int]:
    """Per-device bytes on the device during `phase` that its program does not take:
    the optimizer state (and iteration counter) through the rollout, the frozen
    models through the update."""
    if phase == "rollout":
        return {"optimizer_state": device_bytes(state.opt_state),
                "iteration": device_bytes(state.iteration)}
    return {"frozen_models": device_bytes(frozen)}


def phase_peak(figures: Dict[str, int], resident: Dict[str, int]) -> int:
    """argument + output - alias + temp + generated code + resident elsewhere."""
    return (figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"]
            + figures["temp_bytes"] + figures["generated_code_bytes"] + sum(resident.values()))


def _per_model(tree) -> Dict[str, int]:
    return {name: device_bytes(sub) for name, sub in tree.items()
            if not name.endswith("_head")} | (
        {"heads": device_bytes({k: v for k, v in tree.items() if k.endswith("_head")})}
        if any(k.endswith("_head") for k in tree) else {})


def _opt_per_model(trainer: PPOTrainer, params) -> Dict[str, int]:
    out = {}
    for name, sub in params.items():
        shapes = jax.eval_shape(trainer.optimizer.init, {name: sub})
        param_sh = jax.tree.map(lambda x: x.sharding, {name: sub})
        shs = sharding.opt_state_shardings(trainer.optimizer, param_sh, shapes, trainer.mesh)
        out[name] = device_bytes(jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shs))
    return out


def analytic_breakdown(trainer: PPOTrainer, state: TrainState, frozen) -> Dict[str, Any]:
    """Where the bytes of each phase go, per device, computed from the shapes.

    Exact: parameters, gradients (fp32, like the parameters) and optimizer state
    per trained model, frozen models. Estimates (formulas in the code): the
    sampler's KV cache and the activations of one micro-batch.
    """
    cfg, mesh = trainer.cfg, trainer.mesh
    batch_devices = math.prod(mesh.shape[a] for a in sharding.DEFAULT_AXIS_RULES["batch"]
                              if a in mesh.shape)
    tensor = mesh.shape.get("tensor", 1)
    params = _per_model(state.params)
    optimizer = _opt_per_model(trainer, state.params)
    frozen_b = {k: device_bytes(v) for k, v in (frozen or {}).items() if v is not None}
    pol = trainer.models.policy
    act = jnp.dtype(pol.compute_dtype).itemsize
    seq = cfg.query_length + cfg.response_length
    rollout_rows = (cfg.rollout_micro_batch_size or cfg.batch_size) // batch_devices
    update_rows = max(cfg.microbatch_size // batch_devices, 1)
    kv = 2 * pol.n_layers * rollout_rows * max(pol.n_kv_heads // tensor, 1) * seq \
        * pol.head_dim * act

    def layer_work(c: ModelConfig, rows: int) -> int:
        # one layer's transient tensors: qkv + attention out + mlp hidden, and fp32 scores
        width = (4 * c.d_model + c.d_ff * (2 if c.gated_mlp else 1)) // tensor
        return rows * seq * width * act + rows * (c.n_heads // tensor) * seq * seq * 4

    trained = [c for c in (trainer.models.policy, trainer.models.critic) if c is not None]
    biggest = max(trained + ([trainer.models.policy]), key=lambda c: c.d_model)
    # Rollout: a scoring pass keeps nothing per layer; one layer's work at a time.
    rollout_act = layer_work(biggest, rollout_rows)
    # Update: each trained model keeps its layer inputs (remat "full"; more without it),
    # plus one layer recomputed in the backward, per micro-batch.
    update_act = sum(c.n_layers * update_rows * seq * c.d_model * act for c in trained) \
        + 2 * layer_work(biggest, update_rows)
    resident = sum(params.values()) + sum(optimizer.values()) + sum(frozen_b.values())
    return {
        "parameters": params, "gradients": dict(params), "optimizer_state": optimizer,
        "frozen_models": frozen_b, "resident_bytes": resident,
        "kv_cache_bytes": int(kv), "rollout_micro_batch_rows_per_device": rollout_rows,
        "update_micro_batch_rows_per_device": update_rows,
        "activations_estimate_bytes": {"rollout": int(rollout_act), "update": int(update_act)},
    }


def phase_report(phase: str, compiled, state: TrainState, frozen,
                 breakdown: Dict[str, Any]) -> Dict[str, Any]:
    """One phase's JSON entry: XLA figures, resident elsewhere, peak, and the breakdown."""
    figures = xla_figures(compiled)
    resident = resident_elsewhere(phase, state, frozen)
    out: Dict[str, Any] = dict(figures)
    out["resident_elsewhere_bytes"] = resident
    out["peak_bytes"] = phase_peak(figures, resident)
    gradients = sum(breakdown["gradients"].values()) if phase == "update" else 0
    out["breakdown"] = {
        "parameters": breakdown["parameters"],
        "gradients": breakdown["gradients"] if phase == "update" else {},
        "optimizer_state": breakdown["optimizer_state"],
        "frozen_models": breakdown["frozen_models"],
        "kv_cache_bytes": breakdown["kv_cache_bytes"] if phase == "rollout" else 0,
        "activations_estimate_bytes": breakdown["activations_estimate_bytes"][phase],
        "gradients_bytes": gradients,
    }
    return out


def trainer_plan(trainer: PPOTrainer, state: TrainState, frozen,
                 device_memory: Optional[int] = None) -> Dict[str, Any]:
    """The plan of a trainer whose phases are compiled (`trainer.compile`): reuses the
    compiled programs, compiles nothing. state / frozen: arrays or abstract values."""
    if trainer.compiled is None:
        raise ValueError("trainer_plan needs trainer.compile(...) first")
    breakdown = analytic_breakdown(trainer, state, frozen)
    phases = {p: phase_report(p, trainer.compiled[p], state, frozen, breakdown)
              for p in PHASES}
    peak = max(p["peak_bytes"] for p in phases.values())
    return {"devices": int(trainer.mesh.size),
            "device_memory_bytes": device_memory,
            "fits": None if device_memory is None else bool(peak <= device_memory),
            "peak_bytes": peak,
            "mesh": dict(trainer.mesh.shape),
            "phases": phases,
            "resident_bytes": breakdown["resident_bytes"],
            "compile_seconds": trainer.compile_seconds}


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
    peak = phase_peak(figures, resident_elsewhere(phase, run.state, run.frozen))
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


def to_text(result: Dict[str, Any]) -> str:
    """The plan as text readable at a glance."""
    lines = [f"devices: {result['devices']}  mesh: {result.get('mesh')}  device memory: "
             f"{gb(result['device_memory_bytes'])}",
             f"compile: {result.get('compile_seconds') or 0:.1f} s"]
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


def to_json_ready(result: Dict[str, Any]) -> Dict[str, Any]:
    """numpy scalars -> Python numbers (json.dumps-safe)."""
    return jax.tree.map(lambda x: x.item() if isinstance(x, np.generic) else x, result)
