"""Export a checkpoint's policy as a self-contained HF model directory: config.json,
safetensors, the run's tokenizer files and the source's generation_config.json; for a
run with LoRA adapters the adapters merged into the base, or a PEFT adapter directory."""
from __future__ import annotations

import os
import shutil
from typing import Optional, Tuple

import jax

from pjit_ppo import checkpoint, distributed, lora_checkpoints, sharding
from pjit_ppo.config import ConfigError, RunConfig
from pjit_ppo.loading import copy_tokenizer, lm_config, load_lm
from pjit_ppo.models import ModelConfig, param_shapes, peft_export, save_pretrained


def export_policy(workdir: str, output: str, step: Optional[int] = None, *,
                  adapters_only: bool = False) -> Tuple[int, str]:
    """Writes the policy of checkpoint `step` (latest complete when None) to `output`.

    The architecture comes from the run config saved with the checkpoint (its
    model.policy_path's config.json, or model.random). Parameters are restored straight
    into an FSDP layout over all local devices and written one tensor at a time, in
    float32 (the trained master weights). A run with LoRA adapters (model.lora.rank > 0):
    the adapters merged into the float32 base (read from model.policy_path, or drawn
    again from the run's seed), after checking it is the base they were trained on; with
    adapters_only, the adapters alone as a PEFT adapter directory
    (`pjit_ppo.models.peft_export`). Returns (step, output).
    """
    ckpt = checkpoint.RunCheckpointer(workdir, read_only=True)
    step, run_info = ckpt.resolve(step)
    config = RunConfig.from_dict(run_info["config"])
    mesh = sharding.make_mesh(fsdp=-1)
    if config.model.lora.enabled:
        _export_lora(ckpt, step, run_info, config, mesh, output, adapters_only)
        return step, output
    if adapters_only:
        raise ConfigError(f"--adapters_only: the run in {workdir} trained the whole policy "
                          f"(model.lora.rank=0); export it without --adapters_only")
    if config.model.policy_path:
        model_cfg = ModelConfig.from_pretrained(config.model.policy_path)
    else:
        model_cfg = ModelConfig.from_hf_dict(dict(config.model.random))
    shapes = param_shapes(model_cfg)
    shardings = sharding.param_shardings(shapes, mesh)
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, shardings)
    _, params = ckpt.restore_policy(step, target)
    save_pretrained(output, model_cfg, params)
    _copy_companions(config, output)
    return step, output


def _export_lora(ckpt, step: int, run_info, config: RunConfig, mesh, output: str,
                 adapters_only: bool) -> None:
    """A LoRA run's policy: merged into its base, or (adapters_only) a PEFT directory."""
    base_cfg = lm_config(config.model, config.model.policy_path)
    adapted = lora_checkpoints.adapted_config(config.model, base_cfg)
    if adapters_only:
        _, adapters = lora_checkpoints.restore_adapters(ckpt, step, adapted, mesh)
        adapters = jax.tree.map(distributed.host_array, adapters)  # small: every process
        if jax.process_index() == 0:
            peft_export.save_peft_adapters(output, adapted, adapters,
                                           base_model=config.model.policy_path)
        _copy_companions(config, output, generation=False)
        return
    base_cfg, base = load_lm(config.model, config.model.policy_path, mesh, config.ppo.seed)
    params = lora_checkpoints.merged_policy(ckpt, step, run_info, adapted, base, mesh)
    save_pretrained(output, base_cfg, params)
    _copy_companions(config, output)


def _copy_companions(config: RunConfig, output: str, generation: bool = True) -> None:
    """What makes the export loadable on its own: the run's tokenizer (data.tokenizer_path,
    else the policy's) and the policy's generation_config.json when it has one."""
    if jax.process_index() != 0:
        return
    os.makedirs(output, exist_ok=True)
    tokenizer = config.data.tokenizer_path or config.model.policy_path
    if tokenizer:
        copy_tokenizer(tokenizer, output)
    source = config.model.policy_path
    generation = os.path.join(source, "generation_config.json") if source and generation \
        else ""
    if generation and os.path.isfile(generation):
        shutil.copyfile(generation, os.path.join(output, "generation_config.json"))
