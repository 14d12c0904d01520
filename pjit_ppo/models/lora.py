"""LoRA adapters (Hu et al. 2021) on the decoder's projections: which weights are adapted,
the adapter tree of a model, the low-rank term of the forward pass, merging into the
weights, a mesh-independent fingerprint of the frozen base, and parameter counts.
Stage-neutral (no stage imports it from here): SFT, DPO, PPO, evaluation, export and the
planner build on it.

An adapted projection `transformer/layers/<module>/w` (stacked over the L layers:
[L, *in, *out]) gains two parameters in the same module:

  lora_a  [L, *in, rank]   float32, random normal with std 1 / sqrt(prod(in))
  lora_b  [L, rank, *out]  float32, zeros (training starts at the base model)

and the layer computes x @ W + (alpha / rank) * (dropout(x) @ lora_a) @ lora_b in the
compute dtype (`transformer._dense`). This unmerged form gives the frozen W no gradient:
no full-size weight gradient is formed, and the base stays in the compute dtype. A
model config says which projections carry adapters (`ModelConfig.lora`, a `LoraSpec`):
`with_adapters(config, spec)` makes the policy's, `without_adapters(config)` the
base's, the reference forward on the same base tree.

Trees: a base tree is the usual Haiku parameter dict; an adapter tree holds only the
modules above with their {"lora_a", "lora_b"}; `attach(base, adapters)` is the tree the
adapted forward reads (a dict union: no copy). Adapters shard by the base weight's
partition rule (`pjit_ppo.sharding`): lora_a's input dims and lora_b's output dims
follow W's, the rank dim is replicated.

Dropout (spec.dropout > 0) acts only in the training steps, which pass a key to
`attach` (`DROPOUT_MODULE`, one key per layer); sampling, scoring, the reference and
evaluation pass none and compute without it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from pjit_ppo.errors import ConfigError

#: The adapter parameters of an adapted module.
ADAPTER_NAMES = ("lora_a", "lora_b")
#: The module of a training view holding one dropout key per layer (uint32 [L, 2]).
DROPOUT_MODULE = "transformer/layers/lora_dropout"
#: Every adaptable projection (module under transformer/layers) -> how many leading dims
#: of its weight (after the layers axis) are inputs; the rest are outputs.
PROJECTIONS: Dict[str, int] = {"attn/q": 1, "attn/k": 1, "attn/v": 1, "attn/o": 2,
                               "mlp/fc_in": 1, "mlp/fc_gate": 1, "mlp/fc_out": 1}
_LAYERS = "transformer/layers/"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The adapters of a model (hashable: part of `ModelConfig`, closed over by jit).

    rank: r >= 1; alpha: the output scale is alpha / rank; targets: regexes searched in
    the weight paths ("transformer/layers/attn/q/w"); dropout: on the adapters' input in
    training steps, in [0, 1).
    """
    rank: int
    alpha: float
    targets: Tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def spec_from_options(options) -> Optional[LoraSpec]:
    """The LoraSpec of a config's `model.lora` section (`LoraOptions`); None at rank 0."""
    if options is None or options.rank <= 0:
        return None
    return LoraSpec(rank=int(options.rank), alpha=float(options.alpha),
                    targets=tuple(options.targets), dropout=float(options.dropout))


def with_adapters(config, spec: Optional[LoraSpec]):
    """`config` (a ModelConfig) whose targeted projections carry adapters (spec None:
    `config` unchanged). Raises ConfigError when no projection of it is targeted."""
    if spec is None:
        return config
    config = config.replace(lora=spec)
    if not adapted_modules(config):
        raise ConfigError(f"model.lora.targets={spec.targets!r} matches no projection of this "
                          f"{config.architecture} model (its projections: "
                          f"{', '.join(_LAYERS + m + '/w' for m in _present(config))})")
    return config


def without_adapters(config):
    """The base model's config: `config` without adapters (the reference's forward)."""
    return config if getattr(config, "lora", None) is None else config.replace(lora=None)


def _present(config) -> Tuple[str, ...]:
    return tuple(m for m in PROJECTIONS if m != "mlp/fc_gate" or config.gated_mlp)


@functools.lru_cache(maxsize=None)
def _targeted(targets: Tuple[str, ...], module: str) -> bool:
    path = f"{_LAYERS}{module}/w"
    return any(re.search(t, path) for t in targets)


def layer_adapter(config, module: str) -> Optional[Tuple[int, float, float]]:
    """(rank, scale, dropout) of projection `module` ("attn/q", ...) in `config`, or None
    when it carries no adapter. What `transformer._dense` asks."""
    spec = getattr(config, "lora", None)
    if spec is None or not _targeted(spec.targets, module):
        return None
    return spec.rank, spec.scale, spec.dropout


def adapted_modules(config) -> Tuple[str, ...]:
    """The full module paths ("transformer/layers/attn/q", ...) that carry adapters."""
    spec = getattr(config, "lora", None)
    if spec is None:
        return ()
    return tuple(_LAYERS + m for m in _present(config) if _targeted(spec.targets, m))


def projection_shape(config, module: str) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(in dims, out dims) of a projection's per-layer weight (module "attn/q", ...)."""
    c = config
    d, f, h, kv, hd = c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim
    return {"attn/q": ((d,), (h, hd)), "attn/k": ((d,), (kv, hd)), "attn/v": ((d,), (kv, hd)),
            "attn/o": ((h, hd), (d,)), "mlp/fc_in": ((d,), (f,)), "mlp/fc_gate": ((d,), (f,)),
            "mlp/fc_out": ((f,), (d,))}[module]


def adapter_shapes(config) -> Dict[str, Dict[str, jax.ShapeDtypeStruct]]:
    """The adapter tree of `config` as float32 jax.ShapeDtypeStructs (no sharding)."""
    spec, out = config.lora, {}
    for path in adapted_modules(config):
        ins, outs = projection_shape(config, path[len(_LAYERS):])
        out[path] = {"lora_a": jax.ShapeDtypeStruct((config.n_layers, *ins, spec.rank),
                                                    jnp.float32),
                     "lora_b": jax.ShapeDtypeStruct((config.n_layers, spec.rank, *outs),
                                                    jnp.float32)}
    return out


def init_adapters(config, key: jax.Array) -> Dict[str, Dict[str, jax.Array]]:
    """Fresh adapters of `config`: lora_a ~ N(0, 1 / prod(in)), lora_b = 0; float32.
    Each module draws from its own fold of `key` (by its index in `adapted_modules`)."""
    out = {}
    for i, (path, shapes) in enumerate(adapter_shapes(config).items()):
        a, b = shapes["lora_a"], shapes["lora_b"]
        fan_in = math.prod(a.shape[1:-1])
        out[path] = {"lora_a": jax.random.normal(jax.random.fold_in(key, i), a.shape,
                                                 jnp.float32) / math.sqrt(fan_in),
                     "lora_b": jnp.zeros(b.shape, jnp.float32)}
    return out


# ------------------------------------------------------------------ trees
def is_adapter(name: str) -> bool:
    """Whether a parameter name (the last path part) is an adapter's."""
    return name in ADAPTER_NAMES


def adapters_of(tree) -> Dict[str, Dict[str, Any]]:
    """The adapter leaves of a tree (e.g. `init_params` of an adapted config)."""
    return {m: {n: v for n, v in leaves.items() if is_adapter(n)}
            for m, leaves in tree.items() if any(is_adapter(n) for n in leaves)}


def base_of(tree) -> Dict[str, Dict[str, Any]]:
    """A tree without its adapter leaves (and without a dropout module)."""
    out = {}
    for m, leaves in tree.items():
        kept = {n: v for n, v in leaves.items() if not is_adapter(n)}
        if kept and m != DROPOUT_MODULE:
            out[m] = kept
    return out


def attach(base, adapters, dropout_key: Optional[jax.Array] = None):
    """The tree an adapted forward reads: `base`'s modules with `adapters`' leaves added
    (other entries of `adapters`, e.g. a value head, kept as they are). No copy: a new
    dict of the same arrays. adapters None: `base` itself.

    dropout_key: a training step's key (spec.dropout > 0): one key per layer goes into
    DROPOUT_MODULE, so the adapters' input is dropped out; None: no dropout.
    """
    if adapters is None:
        return base
    out = {m: dict(leaves) for m, leaves in base.items()}
    layers = None
    for m, leaves in adapters.items():
        out.setdefault(m, {}).update(leaves)
        if "lora_a" in leaves:
            layers = leaves["lora_a"].shape[0]
    if dropout_key is not None and layers is not None:
        out[DROPOUT_MODULE] = {"key": jax.random.key_data(jax.random.split(dropout_key,
                                                                           layers))}
    return out


def delta(spec: LoraSpec, a: jax.Array, b: jax.Array) -> jax.Array:
    """scale * lora_a @ lora_b per layer: float32 [L, *in, *out] from a [L, *in, r] and
    b [L, r, *out]."""
    ins, outs = a.shape[1:-1], b.shape[2:]
    layers, rank = a.shape[0], a.shape[-1]
    d = jnp.einsum("lir,lro->lio", a.reshape(layers, -1, rank).astype(jnp.float32),
                   b.reshape(layers, rank, -1).astype(jnp.float32))
    return (spec.scale * d).reshape((layers, *ins, *outs))


def merge(spec: LoraSpec, base, adapters):
    """The base tree with every adapted weight replaced by W + scale * A @ B (computed in
    float32, stored in W's dtype): an ordinary model of the same architecture, whose
    plain forward equals the adapted one. Jittable; keeps the base's other leaves."""
    out = {m: dict(leaves) for m, leaves in base.items()}
    for m, leaves in adapters.items():
        if "lora_a" not in leaves:
            continue
        w = out[m]["w"]
        out[m]["w"] = (w.astype(jnp.float32)
                       + delta(spec, leaves["lora_a"], leaves["lora_b"])).astype(w.dtype)
    return out


def layer_dropout_key() -> Optional[jax.Array]:
    """Inside a layer's Haiku function: this layer's dropout key, when the tree it reads
    carries one (a training view), else None."""
    import haiku as hk
    module = hk.get_params().get(DROPOUT_MODULE[len(_LAYERS):])
    if module is None:
        return None
    return jax.random.wrap_key_data(module["key"])


# ------------------------------------------------------------------ counts, fingerprint
def count(tree) -> int:
    """Number of parameters (array elements) in a tree."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def _leaf_digest(x: jax.Array) -> jax.Array:
    """uint32 [2]: two weighted sums of the bits of `x`, modulo 2^32, each element weighted
    by a hash of its index. Integer sums do not depend on the order of the additions, so
    the digest is the same on every mesh; no reshape, so no sharded array is gathered."""
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    v = jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32)  # 64-bit: a trailing [2]
    index, stride = jnp.zeros(v.shape, jnp.uint32), 1
    for dim in reversed(range(v.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, v.shape, dim) * jnp.uint32(
            stride % 2**32)
        stride *= v.shape[dim]
    m1 = index * jnp.uint32(2654435761) + jnp.uint32(97)
    m2 = (index ^ jnp.uint32(0x9E3779B9)) * jnp.uint32(2246822519) + jnp.uint32(3266489917)
    return jnp.stack([jnp.sum(v * (m1 | 1), dtype=jnp.uint32),
                      jnp.sum((v + jnp.uint32(1)) * (m2 | 1), dtype=jnp.uint32)])


@functools.partial(jax.jit, static_argnums=1)
def _digests(tree, dtype):
    def one(x):
        if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        return _leaf_digest(x)
    return jax.tree.map(one, tree)


def fingerprint(tree, dtype: Optional[str] = None) -> str:
    """A short hex digest of a parameter tree's values, shapes, dtypes and paths (one pass
    over the weights on their devices; the same on any mesh). Recorded in checkpoints of
    adapters so that a resume, evaluation or export on other base weights is refused.
    dtype: digest the floating leaves as cast to it (the base in the compute dtype, from
    its float32 tree, without keeping a cast copy)."""
    from pjit_ppo.distributed import host_array  # a multi-process run: every process
    digests = jax.tree.map(host_array, _digests(tree, None if dtype is None
                                                else jnp.dtype(dtype).name))
    if dtype is not None:
        dt = jnp.dtype(dtype)
        tree = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, dt if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype), tree)
    h = hashlib.sha256()
    for path, x in sorted(jax.tree_util.tree_flatten_with_path(tree)[0],
                          key=lambda item: jax.tree_util.keystr(item[0])):
        h.update(f"{jax.tree_util.keystr(path)}{tuple(x.shape)}{x.dtype}".encode())
    for path, d in sorted(jax.tree_util.tree_flatten_with_path(digests)[0],
                          key=lambda item: jax.tree_util.keystr(item[0])):
        h.update(np.asarray(d, np.uint32).tobytes())
    return h.hexdigest()[:16]
