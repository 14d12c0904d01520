"""The model families pjit_ppo supports, one module each, keyed by HF `model_type`.

A family module (`gpt2.py`, ...) defines `FAMILY`, a `Family` with its config.json
mapping (both ways), its HF class and base-model prefix, tensor-name aliases and
the `TensorMap` of every parameter. Adding a family is one new module, imported and
listed in `_FAMILIES` below; `ModelConfig` and the HF import/export read only this registry.
"""
from __future__ import annotations

from typing import Dict, Optional

from pjit_ppo.models.families import gpt2, gpt_neox, gptj, llama
from pjit_ppo.models.families.config_json import ModelConfigError
from pjit_ppo.models.families.family import Family

__all__ = ["Family", "REGISTRY", "get", "ModelConfigError"]

# Order is the order error messages list them in.
_FAMILIES = (gptj.FAMILY, gpt2.FAMILY, gpt_neox.FAMILY, llama.FAMILY)
REGISTRY: Dict[str, Family] = {f.model_type: f for f in _FAMILIES}


def get(model_type: Optional[str]) -> Family:
    """The family of HF `model_type` (= ModelConfig.architecture).

    Raises ModelConfigError naming the supported model types when it is not one.
    """
    if model_type not in REGISTRY:
        found = ("no `model_type` in config.json" if model_type is None else
                 f"unsupported model_type {model_type!r} (HF config.json `model_type`)")
        raise ModelConfigError(f"{found}; supported: {', '.join(REGISTRY)}")
    return REGISTRY[model_type]
