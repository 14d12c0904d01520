"""ModelConfig: one description of a decoder-only transformer, read from HF config.json.

The supported families (`pjit_ppo.models.families`: GPT-J, GPT-2, GPT-NeoX/Pythia,
Llama) differ only in the switches below; `transformer.py` reads nothing else.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from pjit_ppo.models import families
from pjit_ppo.models.families import ModelConfigError

__all__ = ["ModelConfig", "ModelConfigError", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = tuple(families.REGISTRY)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    Attributes:
      architecture: one of SUPPORTED_ARCHITECTURES (HF `model_type`).
      vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff: sizes.
      max_positions: length of the learned position table (or the context limit).
      norm: "layernorm" or "rmsnorm"; norm_eps its epsilon.
      activation: "gelu_tanh", "gelu", "silu" or "relu".
      gated_mlp: SwiGLU-style MLP (down(act(gate(x)) * up(x))).
      position: "learned" (GPT-2) or "rotary".
      rotary_dim: number of leading dims of each head that rotary is applied to.
      rotary_interleaved: GPT-J rotates pairs (0,1),(2,3),...; NeoX/Llama rotate halves.
      rope_theta: rotary base.
      parallel_residual: x + attn(ln(x)) + mlp(ln'(x)) instead of sequential blocks.
      shared_parallel_norm: GPT-J feeds attention and MLP from one layer norm.
      qkv_bias, attn_out_bias, mlp_bias: which projections carry a bias.
      tie_word_embeddings: LM head reuses the token embedding.
      lm_head_bias: the (untied) LM head has a bias (GPT-J).
      pad_token_id, bos_token_id, eos_token_id: special ids (pad may be None).
      compute_dtype: dtype of activations and matmuls ("float32" or "bfloat16");
        parameters are kept as they are passed in (fp32 for trainable models).
      remat_policy: "none" (store activations), "full" (recompute each layer), or
        the name of a `jax.checkpoint_policies` entry such as "dots_saveable".
      scan_unroll: layers per iteration of the layer scan (n_layers = fully unrolled:
        longer compiles, sometimes faster steps on CPU).
      lora: a `pjit_ppo.models.lora.LoraSpec` when the targeted projections carry LoRA
        adapters (their lora_a / lora_b parameters; `lora.with_adapters`), else None.
      hf_config: the original config.json dict, kept for export.
    """

    architecture: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_positions: int
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    activation: str = "gelu_tanh"
    gated_mlp: bool = False
    position: str = "rotary"
    rotary_dim: int = 0
    rotary_interleaved: bool = False
    rope_theta: float = 10000.0
    parallel_residual: bool = False
    shared_parallel_norm: bool = False
    qkv_bias: bool = False
    attn_out_bias: bool = False
    mlp_bias: bool = True
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    compute_dtype: str = "float32"
    remat_policy: str = "none"
    scan_unroll: int = 1
    lora: Any = None
    hf_config: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.position == "rotary" and (self.rotary_dim <= 0 or self.rotary_dim > self.head_dim
                                          or self.rotary_dim % 2):
            raise ModelConfigError(
                f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if self.compute_dtype not in ("float32", "bfloat16", "float16"):
            raise ModelConfigError(f"compute_dtype must be float32/bfloat16/float16, "
                                   f"got {self.compute_dtype!r}")

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (e.g. compute_dtype, remat_policy)."""
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        """Parameter count of the LM (trunk + head), for FLOP and memory estimates."""
        d, f, h, kv, hd = self.d_model, self.d_ff, self.n_heads, self.n_kv_heads, self.head_dim
        attn = d * h * hd * 2 + d * kv * hd * 2
        mlp = d * f * (3 if self.gated_mlp else 2)
        per_layer = attn + mlp + 4 * d
        emb = self.vocab_size * d + (self.max_positions * d if self.position == "learned" else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.n_layers * per_layer + emb + head + 2 * d

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, hf: dict, **overrides) -> "ModelConfig":
        """Builds a config from the dict of an HF `config.json`.

        Raises ModelConfigError naming the supported architectures when the
        `model_type` is not one of them.
        """
        family = families.get(hf.get("model_type"))
        fields = family.config_fields(hf)
        fields.update(pad_token_id=hf.get("pad_token_id"), bos_token_id=hf.get("bos_token_id"),
                      eos_token_id=_first(hf.get("eos_token_id")))
        fields.update(overrides)
        return cls(architecture=family.model_type, hf_config=dict(hf), **fields)

    @classmethod
    def from_pretrained(cls, path: str, **overrides) -> "ModelConfig":
        """Reads `path/config.json` (or `path` itself if it is a file); for a llama.cpp
        `.gguf` file, the HF config its metadata describes (`gguf.read_hf_config`)."""
        if str(path).lower().endswith(".gguf"):
            from pjit_ppo.models import gguf  # imports the gguf package only when needed
            return cls.from_hf_dict(gguf.read_hf_config(path), **overrides)
        file = path if os.path.isfile(path) else os.path.join(path, "config.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"no config.json at {file!r}: expected an HF model directory")
        with open(file) as f:
            return cls.from_hf_dict(json.load(f), **overrides)

    def to_hf_dict(self) -> dict:
        """The HF config.json dict for this architecture (the imported one if any)."""
        if self.hf_config is not None:
            return dict(self.hf_config)
        family = families.get(self.architecture)
        return dict(model_type=family.model_type, architectures=[family.hf_class],
                    **family.hf_fields(self), pad_token_id=self.pad_token_id,
                    bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id)


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x
