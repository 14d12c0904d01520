"""Export a checkpoint's policy as an HF model directory (config.json + safetensors)."""
from __future__ import annotations

from typing import Optional, Tuple

import jax

from pjit_ppo import checkpoint, sharding
from pjit_ppo.config import RunConfig
from pjit_ppo.models import ModelConfig, param_shapes, save_pretrained


def export_policy(workdir: str, output: str, step: Optional[int] = None) -> Tuple[int, str]:
    """Writes the policy of checkpoint `step` (latest complete when None) to `output`.

    The architecture comes from the run config saved with the checkpoint (its
    model.policy_path's config.json, or model.random). Parameters are restored straight
    into an FSDP layout over all local devices and written one tensor at a time, in
    float32 (the trained master weights). Returns (step, output).
    """
    ckpt = checkpoint.RunCheckpointer(workdir, read_only=True)
    step, run_info = ckpt.resolve(step)
    config = RunConfig.from_dict(run_info["config"])
    if config.model.policy_path:
        model_cfg = ModelConfig.from_pretrained(config.model.policy_path)
    else:
        model_cfg = ModelConfig.from_hf_dict(dict(config.model.random))
    mesh = sharding.make_mesh(fsdp=-1)
    shapes = param_shapes(model_cfg)
    shardings = sharding.param_shardings(shapes, mesh)
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, shardings)
    _, params = ckpt.restore_policy(step, target)
    save_pretrained(output, model_cfg, params)
    return step, output
