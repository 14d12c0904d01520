"""The policy of a PPO checkpoint whose run trained LoRA adapters (model.lora.rank > 0), as
evaluation and export read it: the adapters from the checkpoint's `policy` item, the
base weights checked against the fingerprint the run recorded (run/ JSON `lora_base`),
and the two merged into an ordinary float32 model. Imports no stage (export may not).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import jax

from pjit_ppo import sharding
from pjit_ppo.errors import ConfigError
from pjit_ppo.models import lora


def adapted_config(model_options, base_config):
    """The policy's adapted ModelConfig (model.lora of the run config), or None at rank 0."""
    spec = lora.spec_from_options(model_options.lora)
    return None if spec is None else lora.with_adapters(base_config, spec)


def check_base(run_info: Dict[str, Any], base, compute_dtype: str, step: int,
               name: str = "policy") -> None:
    """Raises ConfigError unless `base` (the float32 base tree, sharded) cast to the
    compute dtype has the fingerprint checkpoint `step` recorded for `name`'s adapters."""
    saved = (run_info.get("lora_base") or {}).get(name)
    now = lora.fingerprint(base, compute_dtype)
    if saved != now:
        raise ConfigError(f"checkpoint {step}'s LoRA adapters of the {name} were trained on base "
                          f"weights with fingerprint {saved}, but model.policy_path gives "
                          f"{now}: point it at the run's base model")


def restore_adapters(ckpt, step: Optional[int], config, mesh) -> Tuple[int, Any]:
    """(step, the policy's adapters float32) of a checkpoint, sharded like their bases on
    `mesh`. config: the adapted ModelConfig (`adapted_config`)."""
    shapes = lora.adapter_shapes(config)
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, sharding.param_shardings(shapes, mesh))
    return ckpt.restore_policy(step, target)


def merged_policy(ckpt, step: int, run_info: Dict[str, Any], config, base, mesh):
    """The checkpoint's policy as an ordinary model: its adapters merged into `base` (the
    float32 base tree, donated: its buffers become the result's), after checking the
    base's fingerprint. config: the adapted ModelConfig. Returns the float32 tree."""
    check_base(run_info, base, config.compute_dtype, step)
    _, adapters = restore_adapters(ckpt, step, config, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, base)
    return jax.jit(lambda b, a: lora.merge(config.lora, b, a), out_shardings=shardings,
                   donate_argnums=0)(base, adapters)
