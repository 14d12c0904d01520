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

`adapted_lm(make, options, path, seed)` makes a model with LoRA adapters (model.lora):
its frozen base in the compute dtype and fresh adapters, on any maker.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax

from pjit_ppo import rng, sharding
from pjit_ppo.loading import lm_config, load_lm
from pjit_ppo.models import assemble, lora, param_shapes


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
        shapes = param_shapes(config)
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


def adapters(make, config, seed: int, stream: int = 0):
    """Fresh adapters of an adapted ModelConfig (`lora.init_adapters`), float32, sharded
    like their base weights, drawn from rng.stream_key(seed, "lora_init", stream): the
    policy's (stream 0) and a critic's (1) differ; any mesh draws the same."""
    shapes = lora.adapter_shapes(config)
    key = rng.stream_key(seed, "lora_init", stream)
    return make.compute(functools.partial(lora.init_adapters, config),
                        sharding.param_shardings(shapes, make.mesh), key)


def adapted_lm(make, options, path: str, seed: int, stream: int = 0):
    """A language model with LoRA adapters (options.lora, rank > 0): (adapted ModelConfig,
    frozen base tree in the compute dtype, float32 adapters), all sharded on make's mesh.

    The base is `make.lm(options, path, seed)` cast to model.compute_dtype (new buffers;
    with float32 compute the loaded tree itself, nothing being trained in it); the fp32
    copy is not kept. Raises ConfigError when model.lora.targets match no projection.
    """
    config, params = make.lm(options, path, seed)
    config = lora.with_adapters(config, lora.spec_from_options(options.lora))
    base = params if config.compute_dtype == "float32" else make.copy(params,
                                                                       config.compute_dtype)
    del params
    return config, base, adapters(make, config, seed, stream)
