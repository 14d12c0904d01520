"""One sharded optimizer step over micro-batches, for the supervised stages (SFT and
reward learning); PPO has its own update (pjit_ppo/ppo/update.py).

A stage supplies `loss_fn(params, micro_batch) -> (loss_sum, stats)`: the *sum* of
its per-example (or per-token) losses over the micro-batch, and a dict of float32
sums whose "weight" entry is what the loss is a sum over (examples, or trained
tokens). A step sums gradients and stats over the micro-batches (`lax.scan`) and
divides by the total weight, so the step's gradient is the mean over the whole batch
whatever the micro-batching, and every metric is a whole-batch mean. The loop around
the step (batches, cadence, checkpoints) is pjit_ppo/loop.py.

A stage that names everything its loss and optimizer close over (`description`: its
config after every value read from data or tokenizer is resolved, its ModelConfig, the
step count its schedule was built for) gets its steps from the program cache
(`pjit_ppo.program_cache`, on with PJIT_PPO_PROGRAM_CACHE_DIR): a launch that repeats
them loads the compiled programs instead of tracing them.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pjit_ppo import program_cache, sharding

LossFn = Callable[[Any, Dict[str, jax.Array]], Tuple[jax.Array, Dict[str, jax.Array]]]


def batch_devices(mesh: Mesh) -> int:
    """How many ways the batch axes of `mesh` split a batch (mesh.data x mesh.fsdp)."""
    n = 1
    for axis in sharding.DEFAULT_AXIS_RULES["batch"]:
        n *= mesh.shape.get(axis, 1)
    return n


def init_opt_state(optimizer: optax.GradientTransformation, params, mesh: Mesh):
    """The optimizer state, created sharded like its parameters (scalars replicated)."""
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    shapes = jax.eval_shape(optimizer.init, params)
    opt_sh = sharding.opt_state_shardings(optimizer, param_sh, shapes, mesh)
    return jax.jit(optimizer.init, out_shardings=opt_sh)(params)


def put_batch(mesh: Mesh, tree, batch_dim: int = 0):
    """Host numpy arrays -> global arrays split over the mesh's batch axes on `batch_dim`.

    Every process holds the whole host batch and hands each of its devices its slice.
    """
    batch_axes = sharding.DEFAULT_AXIS_RULES["batch"]

    def put(x):
        x = np.asarray(x)
        spec = [None] * x.ndim
        spec[batch_dim] = batch_axes
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P(*spec)),
                                            lambda index: x[index])
    return jax.tree.map(put, tree)


def _zero_stats(loss_fn: LossFn, params, example):
    shapes = jax.eval_shape(lambda p, b: loss_fn(p, b)[1], params, example)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _cached(jitted, name: str, description: Optional[str]):
    """`jitted`; or, with a description and the program cache on, a function that takes
    its program from the cache (compiling and storing it on a miss) at the first call
    and runs that program at every call (all calls have the first call's shapes and
    shardings: a step's batches, an evaluation's padded batches)."""
    if description is None or program_cache.directory() is None:
        return jitted
    program = None

    def run(*args):
        nonlocal program
        if program is None:
            program = program_cache.compiled(name, description, jitted, *args)
        return program(*args)
    return run


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, params,
                    opt_state, mesh: Mesh, *, frozen=None, keyed: bool = False,
                    description: Optional[str] = None):
    """A jitted `(params, opt_state, batch) -> (params, opt_state, metrics)`.

    batch: a dict of arrays [gas, micro, ...] (gas = gradient accumulation steps),
    split over the batch axes on dim 1 (`put_batch(mesh, batch, batch_dim=1)`).
    params and opt_state are donated and come back with the same shardings.
    metrics: {stat: sum / weight for every stat but "weight", "weight": total weight,
    "grad_norm": global norm of the mean gradient (before clipping)}; float32 scalars.

    frozen: a pytree every step reads and never trains (LoRA's base weights), an
    argument of the compiled step (not a constant in it, not donated); keyed: the step
    takes a fourth argument, a PRNG key (LoRA dropout). With either, loss_fn is called
    as loss_fn(params, micro_batch, frozen, key), key being the step key folded with the
    micro-batch's index (None when not keyed).

    description: a string naming everything loss_fn and optimizer close over; with it,
    the compiled step comes from the program cache when that is on (module docstring).
    """
    if frozen is None and not keyed:
        return _cached(_plain_train_step(loss_fn, optimizer, params, opt_state, mesh),
                       "supervised/train_step", description)
    grad_fn = jax.grad(loss_fn, has_aux=True)

    def step(params, opt_state, batch, frozen, key):
        first = jax.tree.map(lambda x: x[0], batch)
        stats = _zero_stats(lambda p, b: loss_fn(p, b, frozen, key), params, first)
        zero = (jax.tree.map(jnp.zeros_like, params), stats)

        def micro(acc, xs):
            mb, i = xs
            grads, stats = grad_fn(params, mb, frozen,
                                   None if key is None else jax.random.fold_in(key, i))
            return jax.tree.map(jnp.add, acc, (grads, stats)), None

        n = jax.tree.leaves(batch)[0].shape[0]
        (grads, stats), _ = jax.lax.scan(micro, zero, (batch, jnp.arange(n)))
        return _apply(optimizer, params, opt_state, grads, stats)

    param_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_sh = jax.tree.map(lambda x: x.sharding, opt_state)
    jitted = _cached(jax.jit(step, out_shardings=(param_sh, opt_sh, sharding.replicated(mesh)),
                             donate_argnums=(0, 1)),
                     "supervised/train_step", description)

    def run(params, opt_state, batch, key=None):
        return jitted(params, opt_state, batch, frozen, key)
    return run


def _apply(optimizer, params, opt_state, grads, stats):
    """The optimizer step on summed gradients and stats: (params, opt_state, metrics)."""
    weight = jnp.maximum(stats["weight"], 1.0)
    grads = jax.tree.map(lambda g: g / weight, grads)
    grad_norm = optax.global_norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {k: v / weight for k, v in stats.items() if k != "weight"}
    metrics.update(weight=stats["weight"], grad_norm=grad_norm)
    return params, opt_state, metrics


def _plain_train_step(loss_fn: LossFn, optimizer, params, opt_state, mesh: Mesh):
    """`make_train_step` without frozen inputs or keys."""
    grad_fn = jax.grad(loss_fn, has_aux=True)

    def step(params, opt_state, batch):
        first = jax.tree.map(lambda x: x[0], batch)
        zero = (jax.tree.map(jnp.zeros_like, params), _zero_stats(loss_fn, params, first))

        def micro(acc, mb):
            grads, stats = grad_fn(params, mb)
            return jax.tree.map(jnp.add, acc, (grads, stats)), None

        (grads, stats), _ = jax.lax.scan(micro, zero, batch)
        return _apply(optimizer, params, opt_state, grads, stats)

    param_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_sh = jax.tree.map(lambda x: x.sharding, opt_state)
    return jax.jit(step, out_shardings=(param_sh, opt_sh, sharding.replicated(mesh)),
                   donate_argnums=(0, 1))


def make_eval_step(loss_fn: LossFn, mesh: Mesh, *, frozen=None,
                   description: Optional[str] = None):
    """A jitted `(params, batch) -> stats sums` over one batch [B, ...] (no gradient).
    frozen, description: as in `make_train_step` (loss_fn then gets frozen, and key
    None)."""
    if frozen is None:
        return _cached(jax.jit(lambda params, batch: loss_fn(params, batch)[1],
                               out_shardings=sharding.replicated(mesh)),
                       "supervised/eval_step", description)
    jitted = _cached(
        jax.jit(lambda params, batch, frozen: loss_fn(params, batch, frozen, None)[1],
                out_shardings=sharding.replicated(mesh)),
        "supervised/eval_step", description)
    return lambda params, batch: jitted(params, batch, frozen)


def evaluate(eval_step, params, mesh: Mesh, batches) -> Dict[str, float]:
    """Whole-set means: sums over `batches` (host dicts [B, ...]) divided by the weight.

    Returns {stat: mean} plus "weight" (the total).
    """
    totals: Dict[str, float] = {}
    for batch in batches:
        stats = jax.device_get(eval_step(params, put_batch(mesh, batch)))
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    weight = max(totals.get("weight", 0.0), 1.0)
    out = {k: v / weight for k, v in totals.items() if k != "weight"}
    out["weight"] = totals.get("weight", 0.0)
    return out


def padded_batches(arrays: Dict[str, np.ndarray], batch_size: int, weight_key: str):
    """Host batches of `batch_size` rows covering every row once, in order.

    The last batch is filled up with copies of row 0 whose `weight_key` entry is zeroed,
    so they add nothing to the sums (every batch has the same shape: one compile).
    """
    n = len(next(iter(arrays.values())))
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        index = np.concatenate([np.arange(start, stop),
                                np.zeros(batch_size - (stop - start), np.int64)])
        batch = {k: np.asarray(v)[index] for k, v in arrays.items()}
        if stop - start < batch_size:
            w = batch[weight_key].copy()
            w[stop - start:] = 0
            batch[weight_key] = w
        yield batch
