"""Named device mesh, logical-axis partition rules, and sharded initialisation.

Two tables decide where every parameter lives:

* param rules: regex on the parameter's path ("transformer/layers/attn/q/w")
  -> one *logical* axis name per dimension ("layers", "embed", "heads", ...).
* axis rules: logical axis -> mesh axis (or tuple of mesh axes, or None).

So switching between FSDP, tensor parallelism or both is a change of the axis
rules only. Mesh axes are always `data`, `fsdp`, `tensor`. LoRA adapters (`lora_a`,
`lora_b` beside a weight `w`) take their axes from the weight's rule (`_adapter_axes`).
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# Regex on the parameter path -> logical axes, one per dimension. Order matters:
# the first rule that matches wins. Paths are searched (re.search), so prefixes
# such as "policy/" or "critic/" in a nested tree still match.
DEFAULT_PARAM_RULES: tuple = (
    (r"transformer/embed/embeddings$", ("vocab", "embed")),
    (r"transformer/pos_embed/embeddings$", (None, "embed")),
    (r"transformer/layers/ln_\d/(scale|offset)$", ("layers", None)),
    (r"transformer/layers/attn/q/w$", ("layers", "embed", "heads", "head_dim")),
    (r"transformer/layers/attn/q/b$", ("layers", "heads", "head_dim")),
    (r"transformer/layers/attn/(k|v)/w$", ("layers", "embed", "kv_heads", "head_dim")),
    (r"transformer/layers/attn/(k|v)/b$", ("layers", "kv_heads", "head_dim")),
    (r"transformer/layers/attn/o/w$", ("layers", "heads", "head_dim", "embed")),
    (r"transformer/layers/attn/o/b$", ("layers", None)),
    (r"transformer/layers/mlp/fc_(in|gate)/w$", ("layers", "embed", "mlp")),
    (r"transformer/layers/mlp/fc_(in|gate)/b$", ("layers", "mlp")),
    (r"transformer/layers/mlp/fc_out/w$", ("layers", "mlp", "embed")),
    (r"transformer/layers/mlp/fc_out/b$", ("layers", None)),
    (r"transformer/ln_f/(scale|offset)$", (None,)),
    (r"lm_head/w$", ("embed", "vocab")),
    (r"lm_head/b$", ("vocab",)),
    (r"(value_head|reward_head)/w$", (None,)),
    (r"(value_head|reward_head)/(b|gain|bias)$", ()),
)

# Logical axis -> mesh axes. FSDP shards the embedding dim of every weight over
# `fsdp`; tensor parallelism shards heads / mlp / vocab over `tensor`. With a mesh
# axis of size 1 the corresponding rule is a no-op, so one table serves all.
DEFAULT_AXIS_RULES: Mapping[str, Any] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "layers": None,
    "head_dim": None,
    "length": None,
}


class ShardingError(ValueError):
    """A parameter without a rule, or a mesh that does not divide a dimension."""


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A Mesh with axes (data, fsdp, tensor); one size may be -1 = all remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ShardingError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} "
                            f"tensor={tensor}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ShardingError(f"{len(devices)} devices are not divisible by the fixed mesh "
                                f"axes (product {known}) in data={data} fsdp={fsdp} "
                                f"tensor={tensor}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ShardingError(f"mesh data={sizes[0]} fsdp={sizes[1]} tensor={sizes[2]} needs "
                            f"{math.prod(sizes)} devices but {len(devices)} are available")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def path_str(path) -> str:
    """'a/b/c' for a jax tree path (dict keys, attributes, sequence indices)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _adapter_axes(name: str, shape, compiled) -> Optional[tuple]:
    """The logical axes of a LoRA adapter leaf (`pjit_ppo.models.lora`) from its base
    weight's rule: lora_a [layers?, *in, rank] keeps the weight's input axes, lora_b
    [layers?, rank, *out] its output axes; the rank axis is replicated. None for other
    leaves."""
    module, _, leaf = name.rpartition("/")
    if leaf not in ("lora_a", "lora_b"):
        return None
    base = f"{module}/w"
    for pattern, axes in compiled:
        if pattern.search(base):
            lead = 1 if axes and axes[0] == "layers" else 0
            n = len(shape) - 1 - lead  # input dims of lora_a, output dims of lora_b
            if leaf == "lora_a":
                return tuple(axes[:lead + n]) + (None,)
            return tuple(axes[:lead]) + (None,) + tuple(axes[len(axes) - n:])
    return None


def _match(name: str, shape, compiled) -> tuple:
    adapter = _adapter_axes(name, shape, compiled)
    if adapter is not None:
        return adapter
    for pattern, axes in compiled:
        if pattern.search(name):
            if len(axes) != len(shape):
                raise ShardingError(f"rule {pattern.pattern!r} gives {len(axes)} axes but "
                                    f"parameter {name!r} has shape {tuple(shape)}")
            return tuple(axes)
    raise ShardingError(f"no partition rule matches parameter {name!r} "
                        f"(shape {tuple(shape)}); add a rule for it")


def spec_for(name: str, shape: Sequence[int], axes: Sequence[Optional[str]], mesh: Mesh,
             axis_rules: Mapping[str, Any] = DEFAULT_AXIS_RULES) -> P:
    """PartitionSpec for one array from its logical axes; checks divisibility.

    A mesh axis is used at most once per array (the first logical axis that asks
    for it gets it). Raises ShardingError naming the array, dimension and mesh.
    """
    used, spec = set(), []
    for dim, (size, logical) in enumerate(zip(shape, axes)):
        mesh_axes = axis_rules.get(logical) if logical is not None else None
        if mesh_axes is None:
            spec.append(None)
            continue
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        mesh_axes = tuple(a for a in mesh_axes if a not in used and mesh.shape[a] > 1)
        n = math.prod(mesh.shape[a] for a in mesh_axes)
        if size % n:
            raise ShardingError(
                f"{name}: dimension {dim} ({logical!r}, size {size}) is not divisible by mesh "
                f"axes {mesh_axes} (size {n}) of mesh {dict(mesh.shape)}; change the mesh or "
                f"map {logical!r} to other mesh axes in the axis rules")
        used.update(mesh_axes)
        spec.append(mesh_axes if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None))
    return P(*spec)


def param_specs(tree, mesh: Mesh, param_rules: Sequence = DEFAULT_PARAM_RULES,
                axis_rules: Mapping[str, Any] = DEFAULT_AXIS_RULES):
    """PartitionSpecs for a parameter tree (arrays or ShapeDtypeStructs)."""
    compiled = [(re.compile(pattern), axes) for pattern, axes in param_rules]

    def one(path, leaf):
        name = path_str(path)
        return spec_for(name, leaf.shape, _match(name, leaf.shape, compiled), mesh, axis_rules)

    return jax.tree_util.tree_map_with_path(one, tree)


def param_shardings(tree, mesh: Mesh, param_rules: Sequence = DEFAULT_PARAM_RULES,
                    axis_rules: Mapping[str, Any] = DEFAULT_AXIS_RULES):
    """NamedShardings for a parameter tree."""
    specs = param_specs(tree, mesh, param_rules, axis_rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, P))


def opt_state_shardings(optimizer: optax.GradientTransformation, params_shardings,
                        opt_state_shapes, mesh: Mesh):
    """Optimizer state follows its parameter: moment trees get the parameter shardings,
    everything else (step counts, hyperparameters) is replicated."""
    rep = replicated(mesh)
    return optax.tree_map_params(optimizer, lambda _, s: s, opt_state_shapes, params_shardings,
                                 transform_non_params=lambda _: rep,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))


def init_sharded(init_fn: Callable[..., Any], mesh: Mesh, *args,
                 param_rules: Sequence = DEFAULT_PARAM_RULES,
                 axis_rules: Mapping[str, Any] = DEFAULT_AXIS_RULES):
    """Runs `init_fn(*args)` so that its outputs are created already sharded.

    Shapes come from `jax.eval_shape`; the jitted init then writes each parameter
    straight into its NamedSharding (no host or single device holds the whole tree).
    """
    shapes = jax.eval_shape(init_fn, *args)
    shardings = param_shardings(shapes, mesh, param_rules, axis_rules)
    return jax.jit(init_fn, out_shardings=shardings)(*args)


def batch_sharding(mesh: Mesh, ndim: int = 2,
                   axis_rules: Mapping[str, Any] = DEFAULT_AXIS_RULES) -> NamedSharding:
    """Sharding of a [batch, ...] array: batch over the `batch` logical axis, rest replicated."""
    batch_axes = axis_rules.get("batch")
    return NamedSharding(mesh, P(batch_axes, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, P())


def constrain(x: jax.Array, mesh: Mesh, logical: Sequence[Optional[str]],
              axis_rules: Mapping[str, Any] = DEFAULT_AXIS_RULES) -> jax.Array:
    """with_sharding_constraint from logical axes (inside jit)."""
    spec = spec_for("activation", x.shape, logical, mesh, axis_rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
