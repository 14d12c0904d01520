"""LoRA adapters as a PEFT adapter directory (what `peft.PeftModel.from_pretrained(base,
DIR)` loads onto the HF base model): adapter_config.json + adapter_model.safetensors.

Each adapted projection W of ours is one HF weight (the family's `TensorMap`); PEFT's
LoRA on that module has lora_A.weight [rank, in] and lora_B.weight [out, rank], its
weight delta (alpha / rank) * B @ A in torch Linear layout [out, in] (GPT-2's Conv1D
[in, out]: PEFT's fan_in_fan_out). Ours are lora_a [L, *in, rank] and lora_b
[L, rank, *out]; per layer, A = lora_a reshaped [in, rank] transposed and
B = lora_b reshaped [rank, out] transposed, when the HF tensor holds our input and output
dims each flattened in our order (separate q/k/v/o and MLP projections: GPT-J, Llama,
GPT-NeoX's dense and MLP, GPT-2's c_proj and MLP). A projection inside a fused HF
tensor (GPT-2's c_attn, GPT-NeoX's query_key_value) has no PEFT LoRA of its own and is
refused.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Mapping

import numpy as np

from pjit_ppo.errors import ConfigError
from pjit_ppo.models import families, lora

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _layout(tm, n_in: int, module: str):
    """(fan_in_fan_out, in HF dim) of a per-layer HF tensor holding an adapted weight."""
    groups, start = [], 0
    for group in tm.split:
        groups.append(tuple(range(start, start + len(group))))
        start += len(group)
    ins, outs = tuple(tm.ours[:n_in]), tuple(tm.ours[n_in:])
    if tm.select or len(groups) != 2 or {ins, outs} != set(groups):
        raise ConfigError(f"--adapters_only: {module} is part of the fused HF tensor "
                          f"{tm.hf.format(i='N')}, which has no PEFT LoRA of its own; target "
                          f"other projections (model.lora.targets) or export the merged model "
                          f"(without --adapters_only)")
    return groups.index(ins) == 0, groups.index(ins)


def save_peft_adapters(output: str, config, adapters: Mapping[str, Mapping[str, np.ndarray]],
                       base_model: str = "") -> List[str]:
    """Writes `adapters` (host float32 arrays, `lora.adapter_shapes(config)`) of the
    adapted ModelConfig `config` to `output` as a PEFT LoRA directory for the HF model
    `base_model` (its path or hub name; "" when the base was drawn at random). Returns
    the file names written. Raises ConfigError for a target inside a fused HF tensor."""
    spec = config.lora
    base_cfg = lora.without_adapters(config)
    maps = families.get(base_cfg.architecture).tensor_maps(base_cfg)
    tensors: Dict[str, np.ndarray] = {}
    fan_in_fan_out, names = set(), []
    for module, leaves in adapters.items():
        tm = maps[(module, "w")]
        fifo, _ = _layout(tm, lora.PROJECTIONS[module[len("transformer/layers/"):]], module)
        fan_in_fan_out.add(fifo)
        names.append(re.escape(tm.hf[:-len(".weight")]).replace(re.escape("{i}"), r"\d+"))
        a, b = np.asarray(leaves["lora_a"], np.float32), np.asarray(leaves["lora_b"], np.float32)
        for layer in range(a.shape[0]):
            name = _PREFIX + tm.name(layer)[:-len(".weight")]
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(
                a[layer].reshape(-1, spec.rank).T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(
                b[layer].reshape(spec.rank, -1).T)
    if len(fan_in_fan_out) > 1:
        raise ConfigError("--adapters_only: the adapted HF modules mix torch Linear and "
                          "Conv1D layouts, which one PEFT config cannot describe")
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "target_modules": "(" + "|".join(sorted(names)) + ")",
        "fan_in_fan_out": fan_in_fan_out.pop(), "bias": "none", "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
        "use_dora": False, "layers_to_transform": None, "rank_pattern": {},
        "alpha_pattern": {}, "revision": None,
    }
    from safetensors.numpy import save_file
    os.makedirs(output, exist_ok=True)
    save_file(tensors, os.path.join(output, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(output, CONFIG_FILE), "w") as f:
        json.dump(adapter_config, f, indent=2)
    return [CONFIG_FILE, WEIGHTS_FILE]
