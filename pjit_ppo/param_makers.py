"""How a run's parameter trees are made: as arrays on the devices, or as abstract shapes.

A run's models are assembled once, by code written against a maker
(`pjit_ppo.ppo.assembly`, the reward kinds' `build`); `Loaded(mesh)` makes real arrays
(the training build, evaluation), `Abstract(mesh)` makes jax.ShapeDtypeStructs with the
same shapes, dtypes and shardings and allocates nothing (the memory planner). So what
the planner measures is what the run allocates.

A maker's operations:
  lm(options, path, seed)   a language model: (ModelConfig, fp32 tree sharded by the
                            partition rules), from an HF directory or random init
  replicated(make)          the small tree `make()` returns (heads), on every device
  put(make, sharding)       the tree `make()` returns, every leaf with `sharding`
  compute(fn, shardings, *args)
                            fn(*args) as one jitted program with those out_shardings
  copy(tree, dtype=None)    new buffers of `tree` (floats cast to dtype), same shardings
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from pjit_ppo import sharding
from pjit_ppo.loading import lm_config, load_lm
from pjit_ppo.models import assemble, init_params


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


class Loaded:
    """Real parameters on `mesh` (the weights read, the random ones drawn)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def lm(self, options, path: str, seed: int):
        """(ModelConfig, fp32 params sharded on the mesh): `path`'s HF directory, or random
        init from options.random with PRNGKey(seed) when path is ""."""
        return load_lm(options, path, self.mesh, seed)

    def put(self, make: Callable[[], Any], target) -> Any:
        return jax.device_put(make(), target)

    def compute(self, fn: Callable, out_shardings, *args) -> Any:
        return jax.jit(fn, out_shardings=out_shardings)(*args)

    def replicated(self, make: Callable[[], Any]) -> Any:
        return self.put(make, sharding.replicated(self.mesh))

    def copy(self, tree, dtype: Optional[str] = None) -> Any:
        """New buffers (a frozen model must never share a buffer with the donated train
        state), floats cast to `dtype` when given."""
        return self.compute(assemble.copy_fn(dtype), _shardings(tree), tree)


class Abstract(Loaded):
    """The same trees as jax.ShapeDtypeStructs with their shardings; nothing is read or
    allocated (a model directory's config.json is read for its shape)."""

    def lm(self, options, path: str, seed: int):
        config = lm_config(options, path)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        shapes = jax.eval_shape(functools.partial(init_params, config), key)
        return config, _with(shapes, sharding.param_shardings(shapes, self.mesh))

    def put(self, make: Callable[[], Any], target) -> Any:
        shapes = jax.eval_shape(make)
        return _with(shapes, jax.tree.map(lambda _: target, shapes))

    def compute(self, fn: Callable, out_shardings, *args) -> Any:
        return _with(jax.eval_shape(fn, *args), out_shardings)


def _with(shapes, shardings):
    """ShapeDtypeStructs of `shapes` carrying the matching leaf of `shardings`."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
