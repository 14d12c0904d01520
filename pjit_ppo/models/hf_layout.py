"""Where each of our parameters lives in an HF checkpoint: the registry's tensor maps.

The per-family tables live in `pjit_ppo.models.families`; `TensorMap` (how one of
our arrays sits inside one HF tensor) in `pjit_ppo.models.families.layout`.
"""
from __future__ import annotations

from typing import Sequence

from pjit_ppo.models import families
from pjit_ppo.models.config import ModelConfig
from pjit_ppo.models.families.layout import Maps, TensorMap

__all__ = ["TensorMap", "tensor_maps", "candidate_names"]


def tensor_maps(config: ModelConfig) -> Maps:
    """{(our module path, param name): TensorMap} for every parameter of `config`."""
    return families.get(config.architecture).tensor_maps(config)


def candidate_names(architecture: str, name: str) -> Sequence[str]:
    """Names `name` may have in a checkpoint: as is, aliases, without the base-model prefix."""
    return families.get(architecture).candidate_names(name)
