"""Where each of our parameters lives in an HF checkpoint, per family.

A `TensorMap` says how one of our arrays (one layer of it, for stacked layer
parameters) is laid out inside one HF tensor, as a pure re-indexing:

1. each HF dimension is factored row-major into sub-dimensions (`split`),
   e.g. a torch Linear weight [n_heads * head_dim, d_model] into
   ((n_heads, head_dim), (d_model,));
2. fused tensors fix some sub-dimensions (`select`), e.g. GPT-2's `c_attn`
   columns (3, n_heads, head_dim) with 0 for q, 1 for k, 2 for v;
3. the remaining sub-dimensions, permuted by `ours`, are our array's dims.

Transposes, QKV splits, head reshapes and (for export) fusing back are all
derived from this one description, for any slice of our array.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Sequence, Tuple

from pjit_ppo.models.config import ModelConfig

# Prefix of the base model inside the *ForCausalLM checkpoints. Checkpoints of the
# bare base model (e.g. the original `gpt2` on the Hub) omit it; we accept both.
BASE_PREFIX = {"gpt2": "transformer.", "gptj": "transformer.", "gpt_neox": "gpt_neox.",
               "llama": "model."}
# Other names a tensor is known by (transformers 5 calls NeoX's embed_out lm_head).
ALIASES = {"embed_out.weight": ("lm_head.weight",)}
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "gptj": "GPTJForCausalLM",
                 "gpt_neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM"}


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our (per-layer) arrays inside one HF tensor.

    Attributes:
      hf: HF tensor name; "{i}" stands for the layer index of stacked parameters.
      split: per HF dim, the sizes it factors into (row-major); their product is
        the HF dim.
      ours: for each of our per-layer dims, the index of the sub-dimension it is
        (sub-dimensions numbered across all of `split`, left to right).
      select: (sub-dimension, index) pairs fixed for this array (fused tensors).
      layered: our array has a leading n_layers axis; "{i}" is filled per layer.
    """
    hf: str
    split: Tuple[Tuple[int, ...], ...]
    ours: Tuple[int, ...]
    select: Tuple[Tuple[int, int], ...] = ()
    layered: bool = True

    @property
    def sub_sizes(self) -> Tuple[int, ...]:
        return tuple(n for group in self.split for n in group)

    @property
    def hf_shape(self) -> Tuple[int, ...]:
        shape = []
        for group in self.split:
            n = 1
            for s in group:
                n *= s
            shape.append(n)
        return tuple(shape)

    @property
    def our_shape(self) -> Tuple[int, ...]:
        """Our per-layer shape (without the layers axis)."""
        return tuple(self.sub_sizes[s] for s in self.ours)

    def name(self, layer=None) -> str:
        return self.hf.format(i=layer) if self.layered else self.hf


# ------------------------------------------------------------- constructors
def _identity(hf, shape, layered=True) -> TensorMap:
    """Same layout as ours: vectors, embeddings, GPT-2 Conv1D [in, out] weights."""
    return TensorMap(hf, tuple((n,) for n in shape), tuple(range(len(shape))), layered=layered)


def _linear(hf, d_in, out_shape, layered=True) -> TensorMap:
    """torch Linear weight [prod(out_shape), d_in] -> ours [d_in, *out_shape]."""
    k = len(out_shape)
    return TensorMap(hf, (tuple(out_shape), (d_in,)), (k,) + tuple(range(k)), layered=layered)


def _linear_from_heads(hf, in_shape, d_out) -> TensorMap:
    """torch Linear weight [d_out, prod(in_shape)] -> ours [*in_shape, d_out]."""
    k = len(in_shape)
    return TensorMap(hf, ((d_out,), tuple(in_shape)), tuple(range(1, k + 1)) + (0,))


def _vector(hf, shape) -> TensorMap:
    """A bias [prod(shape)] -> ours `shape`."""
    return TensorMap(hf, (tuple(shape),), tuple(range(len(shape))))


# --------------------------------------------------------------- families
def tensor_maps(config: ModelConfig) -> Dict[Tuple[str, str], TensorMap]:
    """{(our module path, param name): TensorMap} for every parameter of `config`."""
    builders = {"gpt2": _gpt2, "gptj": _gptj, "gpt_neox": _neox, "llama": _llama}
    c = config
    maps = builders[c.architecture](c)
    # Final norm, LM head: shared structure.
    final = {"gpt2": "transformer.ln_f", "gptj": "transformer.ln_f",
             "gpt_neox": "gpt_neox.final_layer_norm", "llama": "model.norm"}[c.architecture]
    maps[("transformer/ln_f", "scale")] = _identity(final + ".weight", (c.d_model,), False)
    if c.norm == "layernorm":
        maps[("transformer/ln_f", "offset")] = _identity(final + ".bias", (c.d_model,), False)
    if not c.tie_word_embeddings:
        head = "embed_out" if c.architecture == "gpt_neox" else "lm_head"
        maps[("lm_head", "w")] = _linear(head + ".weight", c.d_model, (c.vocab_size,), False)
        if c.lm_head_bias:
            maps[("lm_head", "b")] = _identity(head + ".bias", (c.vocab_size,), False)
    return maps


def _norms(maps, c, prefix, names):
    for ours, theirs in names:
        maps[(f"transformer/layers/{ours}", "scale")] = _identity(f"{prefix}.{theirs}.weight",
                                                                  (c.d_model,))
        if c.norm == "layernorm":
            maps[(f"transformer/layers/{ours}", "offset")] = _identity(
                f"{prefix}.{theirs}.bias", (c.d_model,))


def _separate_qkv(maps, c, prefix, names, bias):
    """Separate q/k/v/o torch Linears (GPT-J, Llama)."""
    h, kv, hd, d = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model
    for ours, theirs, heads in zip("qkv", names[:3], (h, kv, kv)):
        maps[(f"transformer/layers/attn/{ours}", "w")] = _linear(f"{prefix}.{theirs}.weight", d,
                                                                 (heads, hd))
        if bias:
            maps[(f"transformer/layers/attn/{ours}", "b")] = _vector(f"{prefix}.{theirs}.bias",
                                                                     (heads, hd))
    maps[("transformer/layers/attn/o", "w")] = _linear_from_heads(f"{prefix}.{names[3]}.weight",
                                                                  (h, hd), d)


def _mlp(maps, c, prefix, names, conv1d=False):
    """fc_in / fc_gate / fc_out from torch Linears (or GPT-2 Conv1D, already [in, out])."""
    d, f = c.d_model, c.d_ff
    for ours, theirs in names:
        d_in, d_out = (f, d) if ours == "fc_out" else (d, f)
        w = f"{prefix}.{theirs}.weight"
        maps[(f"transformer/layers/mlp/{ours}", "w")] = (
            _identity(w, (d_in, d_out)) if conv1d else _linear(w, d_in, (d_out,)))
        if c.mlp_bias:
            maps[(f"transformer/layers/mlp/{ours}", "b")] = _identity(f"{prefix}.{theirs}.bias",
                                                                      (d_out,))


def _gpt2(c):
    d, h, hd = c.d_model, c.n_heads, c.head_dim
    p = "transformer.h.{i}"
    maps = {("transformer/embed", "embeddings"): _identity("transformer.wte.weight",
                                                           (c.vocab_size, d), False),
            ("transformer/pos_embed", "embeddings"): _identity("transformer.wpe.weight",
                                                               (c.max_positions, d), False)}
    _norms(maps, c, p, [("ln_1", "ln_1"), ("ln_2", "ln_2")])
    for j, ours in enumerate("qkv"):  # c_attn: Conv1D [d, 3 * d], columns q | k | v
        maps[(f"transformer/layers/attn/{ours}", "w")] = TensorMap(
            f"{p}.attn.c_attn.weight", ((d,), (3, h, hd)), (0, 2, 3), ((1, j),))
        maps[(f"transformer/layers/attn/{ours}", "b")] = TensorMap(
            f"{p}.attn.c_attn.bias", ((3, h, hd),), (1, 2), ((0, j),))
    maps[("transformer/layers/attn/o", "w")] = TensorMap(f"{p}.attn.c_proj.weight",
                                                         ((h, hd), (d,)), (0, 1, 2))
    maps[("transformer/layers/attn/o", "b")] = _identity(f"{p}.attn.c_proj.bias", (d,))
    _mlp(maps, c, p, [("fc_in", "mlp.c_fc"), ("fc_out", "mlp.c_proj")], conv1d=True)
    return maps


def _gptj(c):
    p = "transformer.h.{i}"
    maps = {("transformer/embed", "embeddings"): _identity("transformer.wte.weight",
                                                           (c.vocab_size, c.d_model), False)}
    _norms(maps, c, p, [("ln_1", "ln_1")])
    _separate_qkv(maps, c, p, ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"],
                  c.qkv_bias)
    _mlp(maps, c, p, [("fc_in", "mlp.fc_in"), ("fc_out", "mlp.fc_out")])
    return maps


def _neox(c):
    d, h, hd = c.d_model, c.n_heads, c.head_dim
    p = "gpt_neox.layers.{i}"
    maps = {("transformer/embed", "embeddings"): _identity("gpt_neox.embed_in.weight",
                                                           (c.vocab_size, d), False)}
    _norms(maps, c, p, [("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")])
    for j, ours in enumerate("qkv"):  # rows: (head, {q, k, v}, head_dim)
        maps[(f"transformer/layers/attn/{ours}", "w")] = TensorMap(
            f"{p}.attention.query_key_value.weight", ((h, 3, hd), (d,)), (3, 0, 2), ((1, j),))
        if c.qkv_bias:
            maps[(f"transformer/layers/attn/{ours}", "b")] = TensorMap(
                f"{p}.attention.query_key_value.bias", ((h, 3, hd),), (0, 2), ((1, j),))
    maps[("transformer/layers/attn/o", "w")] = _linear_from_heads(
        f"{p}.attention.dense.weight", (h, hd), d)
    if c.attn_out_bias:
        maps[("transformer/layers/attn/o", "b")] = _identity(f"{p}.attention.dense.bias", (d,))
    _mlp(maps, c, p, [("fc_in", "mlp.dense_h_to_4h"), ("fc_out", "mlp.dense_4h_to_h")])
    return maps


def _llama(c):
    p = "model.layers.{i}"
    maps = {("transformer/embed", "embeddings"): _identity("model.embed_tokens.weight",
                                                           (c.vocab_size, c.d_model), False)}
    _norms(maps, c, p, [("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")])
    _separate_qkv(maps, c, p, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                               "self_attn.o_proj"], c.qkv_bias)
    if c.attn_out_bias:
        maps[("transformer/layers/attn/o", "b")] = _identity(f"{p}.self_attn.o_proj.bias",
                                                             (c.d_model,))
    _mlp(maps, c, p, [("fc_in", "mlp.up_proj"), ("fc_gate", "mlp.gate_proj"),
                      ("fc_out", "mlp.down_proj")])
    return maps


def candidate_names(architecture: str, name: str) -> Sequence[str]:
    """Names `name` may have in a checkpoint: as is, without the base-model prefix, aliases."""
    out = [name] + list(ALIASES.get(name, ()))
    prefix = BASE_PREFIX[architecture]
    if name.startswith(prefix):
        out.append(name[len(prefix):])
    return out
