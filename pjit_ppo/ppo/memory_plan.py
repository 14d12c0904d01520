"""The memory plan of a PPO trainer's two compiled phases, per device: XLA's figures
(`pjit_ppo.memory_analysis`), what stays resident beside each program (the optimizer
state through the rollout, the frozen models through the update), the peak, and an
analytic breakdown (parameters, gradients and optimizer state per trained model, frozen
models, KV cache, activation estimate), the resident bytes split into LoRA base,
adapters, other trained parameters, optimizer state and frozen models, and the
trainable and total parameter counts. What a run logs at its start
(`pjit_ppo.ppo.run`) and what the planner reports (`pjit_ppo.planning`).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp

from pjit_ppo import sharding
from pjit_ppo.memory_analysis import device_bytes, phase_peak, xla_figures
from pjit_ppo.models import ModelConfig, lora
from pjit_ppo.ppo import lora_views
from pjit_ppo.ppo.trainer import PHASES, PPOTrainer
from pjit_ppo.ppo.types import PPOModels, TrainState


def rollout_arguments(state: TrainState, frozen, query, query_mask):
    """What the rollout program takes (beside its key): the parameters, the frozen
    models, the KL coefficient and the prompts (arrays or abstract values)."""
    return state.params, frozen, state.kl_coef, query, query_mask


def resident_elsewhere(phase: str, state: TrainState, frozen,
                       models: Optional[PPOModels] = None) -> Dict[str, int]:
    """Per-device bytes on the device during `phase` that its program does not take:
    the optimizer state (and iteration counter) through the rollout, the frozen
    models through the update (but the LoRA bases, which the update takes: `models`
    says which, `lora_views.update_frozen`)."""
    if phase == "rollout":
        return {"optimizer_state": device_bytes(state.opt_state),
                "iteration": device_bytes(state.iteration)}
    passed = lora_views.update_frozen(models, frozen) if models is not None else None
    return {"frozen_models": device_bytes({k: v for k, v in (frozen or {}).items()
                                           if k not in (passed or {})})}


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
                 breakdown: Dict[str, Any], models: Optional[PPOModels] = None
                 ) -> Dict[str, Any]:
    """One phase's JSON entry: XLA figures, resident elsewhere, peak, and the breakdown."""
    figures = xla_figures(compiled)
    resident = resident_elsewhere(phase, state, frozen, models)
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


def _unique_leaves(tree):
    """The distinct arrays of a tree (a frozen model shared by two entries counts once)."""
    seen, out = set(), []
    for leaf in jax.tree.leaves(tree):
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(leaf)
    return out


def _count(leaves) -> int:
    return int(sum(math.prod(x.shape) for x in leaves))


def parameter_counts(state: TrainState, frozen) -> Dict[str, int]:
    """{"trainable_parameters": elements of the trained tree (with LoRA: the adapters and
    heads), "total_parameters": those and every frozen model's (the base / reference,
    the reward model), each array once}."""
    trainable = _count(jax.tree.leaves(state.params))
    return {"trainable_parameters": trainable,
            "total_parameters": trainable + _count(_unique_leaves(frozen or {}))}


def resident_breakdown(trainer: PPOTrainer, state: TrainState, frozen) -> Dict[str, int]:
    """The resident bytes per device (`resident_bytes`: parameters, optimizer state and
    frozen models) in five parts: "base" (the frozen base LoRA adapters sit on, which is
    also the reference; 0 without LoRA), "adapters" (the LoRA adapter leaves), "trained"
    (the other trained parameters: the whole policy and critic without LoRA, value heads,
    a full critic), "optimizer_state" and "frozen_models" (the other frozen models: the
    reward model; the reference without LoRA)."""
    adapters = device_bytes([x for path, x in jax.tree_util.tree_flatten_with_path(
        state.params)[0] if sharding.path_str(path).rsplit("/", 1)[-1] in lora.ADAPTER_NAMES])
    base = frozen["ref"] if lora_views.uses_adapters(trainer.models) else {}
    others = {k: v for k, v in (frozen or {}).items() if v is not None and v is not base}
    return {"base": device_bytes(base), "adapters": adapters,
            "trained": device_bytes(state.params) - adapters,
            "optimizer_state": device_bytes(state.opt_state),
            "frozen_models": device_bytes(others)}


def trainer_plan(trainer: PPOTrainer, state: TrainState, frozen,
                 device_memory: Optional[int] = None) -> Dict[str, Any]:
    """The plan of a trainer whose phases are compiled (`trainer.compile`): reuses the
    compiled programs, compiles nothing. state / frozen: arrays or abstract values."""
    missing = [p for p in PHASES if p not in (trainer.compiled or {})]
    if missing:
        raise ValueError(f"trainer_plan needs the {' and '.join(missing)} phase compiled: "
                         f"call trainer.compile(...) first")
    breakdown = analytic_breakdown(trainer, state, frozen)
    phases = {p: phase_report(p, trainer.compiled[p], state, frozen, breakdown,
                              trainer.models)
              for p in PHASES}
    peak = max(p["peak_bytes"] for p in phases.values())
    return {"devices": int(trainer.mesh.size),
            "device_memory_bytes": device_memory,
            "fits": None if device_memory is None else bool(peak <= device_memory),
            "peak_bytes": peak,
            "mesh": dict(trainer.mesh.shape),
            "phases": phases,
            "resident_bytes": breakdown["resident_bytes"],
            "resident_breakdown_bytes": resident_breakdown(trainer, state, frozen),
            **parameter_counts(state, frozen),
            "compile_seconds": trainer.compile_seconds}


