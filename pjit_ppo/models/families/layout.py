"""How our parameters sit inside HF tensors: `TensorMap` and the builders families share.

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

The builders below add entries to a family's map, a dict
{(our module path, param name): TensorMap}; layer tensor names contain "{i}".
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Sequence, Tuple

if TYPE_CHECKING:
    from pjit_ppo.models.config import ModelConfig

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
        """Sizes of all sub-dimensions, left to right."""
        return tuple(n for group in self.split for n in group)

    @property
    def hf_shape(self) -> Tuple[int, ...]:
        """Shape of the HF tensor (of one layer)."""
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
        """The HF tensor name, for `layer` if the parameter is stacked."""
        return self.hf.format(i=layer) if self.layered else self.hf


# A family's map: {(our module path, param name): TensorMap}.
Maps = Dict[Tuple[str, str], TensorMap]


# ---------------------------------------------------------- single tensors
def identity(hf: str, shape: Sequence[int], layered: bool = True) -> TensorMap:
    """Same layout as ours: vectors, embeddings, GPT-2 Conv1D [in, out] weights."""
    return TensorMap(hf, tuple((n,) for n in shape), tuple(range(len(shape))), layered=layered)


def linear(hf: str, d_in: int, out_shape: Sequence[int], layered: bool = True) -> TensorMap:
    """torch Linear weight [prod(out_shape), d_in] -> ours [d_in, *out_shape]."""
    k = len(out_shape)
    return TensorMap(hf, (tuple(out_shape), (d_in,)), (k,) + tuple(range(k)), layered=layered)


def linear_from_heads(hf: str, in_shape: Sequence[int], d_out: int) -> TensorMap:
    """torch Linear weight [d_out, prod(in_shape)] -> ours [*in_shape, d_out]."""
    k = len(in_shape)
    return TensorMap(hf, ((d_out,), tuple(in_shape)), tuple(range(1, k + 1)) + (0,))


def vector(hf: str, shape: Sequence[int]) -> TensorMap:
    """A bias [prod(shape)] -> ours `shape`."""
    return TensorMap(hf, (tuple(shape),), tuple(range(len(shape))))


# ------------------------------------------------------- groups of tensors
def norms(maps: Maps, c: ModelConfig, prefix: str, names: Sequence[Tuple[str, str]]) -> None:
    """Per-layer norms: (our name, HF name) pairs; scale [d_model] (+ offset for layernorm)."""
    for ours, theirs in names:
        maps[(f"transformer/layers/{ours}", "scale")] = identity(f"{prefix}.{theirs}.weight",
                                                                 (c.d_model,))
        if c.norm == "layernorm":
            maps[(f"transformer/layers/{ours}", "offset")] = identity(
                f"{prefix}.{theirs}.bias", (c.d_model,))


def separate_qkv(maps: Maps, c: ModelConfig, prefix: str, names: Sequence[str],
                 bias: bool) -> None:
    """Separate q/k/v/o torch Linears (GPT-J, Llama); `names` are the HF q, k, v, o modules.

    q/k/v weights: ours [d_model, heads, head_dim] (kv_heads for k and v), biases
    [heads, head_dim] when `bias`; o weight: ours [n_heads, head_dim, d_model], no bias
    (families with one add it themselves).
    """
    h, kv, hd, d = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model
    for ours, theirs, heads in zip("qkv", names[:3], (h, kv, kv)):
        maps[(f"transformer/layers/attn/{ours}", "w")] = linear(f"{prefix}.{theirs}.weight", d,
                                                                (heads, hd))
        if bias:
            maps[(f"transformer/layers/attn/{ours}", "b")] = vector(f"{prefix}.{theirs}.bias",
                                                                    (heads, hd))
    maps[("transformer/layers/attn/o", "w")] = linear_from_heads(f"{prefix}.{names[3]}.weight",
                                                                 (h, hd), d)


def mlp(maps: Maps, c: ModelConfig, prefix: str, names: Sequence[Tuple[str, str]],
        conv1d: bool = False) -> None:
    """fc_in / fc_gate / fc_out from torch Linears (or GPT-2 Conv1D, already [in, out]).

    names: (our name, HF module) pairs. Ours are [d_model, d_ff] ([d_ff, d_model] for
    fc_out), with a bias [d_out] when `c.mlp_bias`.
    """
    d, f = c.d_model, c.d_ff
    for ours, theirs in names:
        d_in, d_out = (f, d) if ours == "fc_out" else (d, f)
        w = f"{prefix}.{theirs}.weight"
        maps[(f"transformer/layers/mlp/{ours}", "w")] = (
            identity(w, (d_in, d_out)) if conv1d else linear(w, d_in, (d_out,)))
        if c.mlp_bias:
            maps[(f"transformer/layers/mlp/{ours}", "b")] = identity(f"{prefix}.{theirs}.bias",
                                                                     (d_out,))


def final_norm_and_head(maps: Maps, c: ModelConfig, norm: str, head: str = "lm_head") -> None:
    """The final norm (HF module `norm`) and, unless tied, the LM head (torch Linear `head`).

    ln_f: scale [d_model] (+ offset for layernorm); lm_head: w [d_model, vocab]
    (+ b [vocab] when `c.lm_head_bias`).
    """
    maps[("transformer/ln_f", "scale")] = identity(norm + ".weight", (c.d_model,), False)
    if c.norm == "layernorm":
        maps[("transformer/ln_f", "offset")] = identity(norm + ".bias", (c.d_model,), False)
    if not c.tie_word_embeddings:
        maps[("lm_head", "w")] = linear(head + ".weight", c.d_model, (c.vocab_size,), False)
        if c.lm_head_bias:
            maps[("lm_head", "b")] = identity(head + ".bias", (c.vocab_size,), False)
