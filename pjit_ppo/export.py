"""Export a checkpoint's policy as a self-contained HF model directory: config.json,
safetensors, the run's tokenizer files and the source's generation_config.json."""
from __future__ import annotations

import os
import shutil
from typing import Optional, Tuple

import jax

from pjit_ppo import checkpoint, sharding
from pjit_ppo.config import RunConfig
from pjit_ppo.loading import copy_tokenizer
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
    _copy_companions(config, output)
    return step, output


def _copy_companions(config: RunConfig, output: str) -> None:
    """What makes the export loadable on its own: the run's tokenizer (data.tokenizer_path,
    else the policy's) and the policy's generation_config.json when it has one."""
    if jax.process_index() != 0:
        return
    tokenizer = config.data.tokenizer_path or config.model.policy_path
    if tokenizer:
        copy_tokenizer(tokenizer, output)
    source = config.model.policy_path
    generation = os.path.join(source, "generation_config.json") if source else ""
    if generation and os.path.isfile(generation):
        shutil.copyfile(generation, os.path.join(output, "generation_config.json"))
