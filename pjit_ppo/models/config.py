"""ModelConfig: one description of a decoder-only transformer, read from HF config.json.

The four supported families (GPT-J, GPT-2, GPT-NeoX/Pythia, Llama) differ only in
the switches below; `transformer.py` reads nothing else.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

SUPPORTED_ARCHITECTURES = ("gptj", "gpt2", "gpt_neox", "llama")

# HF activation names -> ours. gelu_new/gelu_pytorch_tanh are the tanh approximation.
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}


class ModelConfigError(ValueError):
    """A config.json that pjit_ppo cannot represent."""


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
        model_type = hf.get("model_type")
        builders = {"gptj": _from_gptj, "gpt2": _from_gpt2, "gpt_neox": _from_neox,
                    "llama": _from_llama}
        if model_type not in builders:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r} in config.json; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        fields = builders[model_type](hf)
        fields.update(pad_token_id=hf.get("pad_token_id"), bos_token_id=hf.get("bos_token_id"),
                      eos_token_id=_first(hf.get("eos_token_id")))
        fields.update(overrides)
        return cls(architecture=model_type, hf_config=dict(hf), **fields)

    @classmethod
    def from_pretrained(cls, path: str, **overrides) -> "ModelConfig":
        """Reads `path/config.json` (or `path` itself if it is a file)."""
        file = path if os.path.isfile(path) else os.path.join(path, "config.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"no config.json at {file!r}: expected an HF model directory")
        with open(file) as f:
            return cls.from_hf_dict(json.load(f), **overrides)

    def to_hf_dict(self) -> dict:
        """The HF config.json dict for this architecture (the imported one if any)."""
        if self.hf_config is not None:
            return dict(self.hf_config)
        return _to_hf(self)


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ModelConfigError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _rope(hf: dict, default_theta: float = 10000.0):
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", default_theta)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                         hf.get("rotary_pct", 1.0)))
    rope_type = params.get("rope_type", (hf.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type not in ("default", None):
        raise ModelConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
    return float(theta), float(partial)


def _from_gpt2(hf):
    d = hf["n_embd"]
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
        raise ModelConfigError("GPT-2 attention-scaling variants are not supported")
    return dict(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["n_layer"],
                n_heads=hf["n_head"], n_kv_heads=hf["n_head"], head_dim=d // hf["n_head"],
                d_ff=hf.get("n_inner") or 4 * d, max_positions=hf["n_positions"],
                norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                activation=_activation(hf.get("activation_function", "gelu_new")),
                position="learned", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
                tie_word_embeddings=True, lm_head_bias=False)


def _from_gptj(hf):
    d = hf["n_embd"]
    hd = d // hf["n_head"]
    return dict(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["n_layer"],
                n_heads=hf["n_head"], n_kv_heads=hf["n_head"], head_dim=hd,
                d_ff=hf.get("n_inner") or 4 * d, max_positions=hf["n_positions"],
                norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                activation=_activation(hf.get("activation_function", "gelu_new")),
                position="rotary", rotary_dim=hf.get("rotary_dim") or hd, rotary_interleaved=True,
                parallel_residual=True, shared_parallel_norm=True, qkv_bias=False,
                attn_out_bias=False, mlp_bias=True,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                lm_head_bias=not hf.get("tie_word_embeddings", False))


def _from_neox(hf):
    d = hf["hidden_size"]
    hd = d // hf["num_attention_heads"]
    theta, partial = _rope(hf)
    bias = hf.get("attention_bias", True)
    return dict(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_attention_heads"],
                head_dim=hd, d_ff=hf["intermediate_size"],
                max_positions=hf.get("max_position_embeddings", 2048), norm="layernorm",
                norm_eps=hf.get("layer_norm_eps", 1e-5),
                activation=_activation(hf.get("hidden_act", "gelu")), position="rotary",
                rotary_dim=int(hd * partial), rope_theta=theta,
                parallel_residual=bool(hf.get("use_parallel_residual", True)),
                qkv_bias=bias, attn_out_bias=bias, mlp_bias=True,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _from_llama(hf):
    d = hf["hidden_size"]
    h = hf["num_attention_heads"]
    hd = hf.get("head_dim") or d // h
    theta, partial = _rope(hf)
    return dict(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"],
                n_heads=h, n_kv_heads=hf.get("num_key_value_heads") or h, head_dim=hd,
                d_ff=hf["intermediate_size"], max_positions=hf.get("max_position_embeddings", 2048),
                norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
                activation=_activation(hf.get("hidden_act", "silu")), gated_mlp=True,
                position="rotary", rotary_dim=int(hd * partial), rope_theta=theta,
                qkv_bias=bool(hf.get("attention_bias", False)),
                attn_out_bias=bool(hf.get("attention_bias", False)),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _to_hf(c: ModelConfig) -> dict:
    """Writes a config.json for a config built by hand (no imported HF dict)."""
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "silu": "silu", "relu": "relu"}[c.activation]
    special = dict(pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
                   eos_token_id=c.eos_token_id)
    if c.architecture == "gpt2":
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=c.vocab_size,
                    n_embd=c.d_model, n_layer=c.n_layers, n_head=c.n_heads, n_inner=c.d_ff,
                    n_positions=c.max_positions, layer_norm_epsilon=c.norm_eps,
                    activation_function=act, tie_word_embeddings=True, **special)
    if c.architecture == "gptj":
        return dict(model_type="gptj", architectures=["GPTJForCausalLM"], vocab_size=c.vocab_size,
                    n_embd=c.d_model, n_layer=c.n_layers, n_head=c.n_heads, n_inner=c.d_ff,
                    n_positions=c.max_positions, rotary_dim=c.rotary_dim,
                    layer_norm_epsilon=c.norm_eps, activation_function=act,
                    tie_word_embeddings=c.tie_word_embeddings, **special)
    if c.architecture == "gpt_neox":
        return dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"],
                    vocab_size=c.vocab_size, hidden_size=c.d_model,
                    num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                    intermediate_size=c.d_ff, max_position_embeddings=c.max_positions,
                    layer_norm_eps=c.norm_eps, hidden_act=act,
                    rotary_pct=c.rotary_dim / c.head_dim, rotary_emb_base=c.rope_theta,
                    rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta,
                                         partial_rotary_factor=c.rotary_dim / c.head_dim),
                    use_parallel_residual=c.parallel_residual, attention_bias=c.qkv_bias,
                    tie_word_embeddings=c.tie_word_embeddings, **special)
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=c.vocab_size,
                hidden_size=c.d_model, num_hidden_layers=c.n_layers,
                num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                head_dim=c.head_dim, intermediate_size=c.d_ff,
                max_position_embeddings=c.max_positions, rms_norm_eps=c.norm_eps, hidden_act=act,
                rope_theta=c.rope_theta,
                rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta),
                attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias,
                tie_word_embeddings=c.tie_word_embeddings, **special)
