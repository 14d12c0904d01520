"""Pieces of HF config.json shared by the families: activation names, rotary settings.

`ModelConfigError` lives here (re-exported by `pjit_ppo.models.config`) because the
family modules raise it and must not import `config.py`, which imports them.
"""
from __future__ import annotations

from typing import Optional, Tuple


class ModelConfigError(ValueError):
    """A config.json that pjit_ppo cannot represent."""


# HF activation names -> ours. gelu_new/gelu_pytorch_tanh/gelu_fast are the tanh
# approximation.
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}
# Ours -> the HF name written for configs built by hand.
_HF_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "silu": "silu", "relu": "relu"}


def activation(name: str) -> str:
    """Our activation name ("gelu_tanh", "gelu", "silu", "relu") for an HF one.

    Raises ModelConfigError listing the supported HF names.
    """
    if name not in _ACTIVATIONS:
        raise ModelConfigError(f"unsupported activation {name!r}; supported: "
                               f"{sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def hf_activation(name: str) -> str:
    """The HF activation name written to config.json for our activation `name`."""
    if name not in _HF_ACTIVATIONS:
        raise ModelConfigError(f"activation {name!r} has no HF name; supported: "
                               f"{sorted(_HF_ACTIVATIONS)}")
    return _HF_ACTIVATIONS[name]


def rope(hf: dict, default_theta: float = 10000.0) -> Tuple[float, float]:
    """(rope_theta, partial rotary factor) of an HF config.json dict.

    Reads transformers 5's `rope_parameters` first, then the older top-level
    `rope_theta` / `rotary_emb_base` and `partial_rotary_factor` / `rotary_pct`.
    Raises ModelConfigError for any rope type but "default" (scaled variants).
    """
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta",
                       hf.get("rope_theta", hf.get("rotary_emb_base", default_theta)))
    partial = params.get("partial_rotary_factor",
                         hf.get("partial_rotary_factor", hf.get("rotary_pct", 1.0)))
    rope_type: Optional[str] = params.get(
        "rope_type", (hf.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type not in ("default", None):
        raise ModelConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
    return float(theta), float(partial)
