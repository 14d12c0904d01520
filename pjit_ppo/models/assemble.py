"""Assembling the four models of a run from LM parameter trees.

policy    trainable, fp32, the LM tree
critic    trainable, fp32: a trunk (from the reward model or the policy) + zero value head
reference frozen copy of the initial policy, stored in the compute dtype
reward    frozen, compute dtype: trunk + reward head
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pjit_ppo import sharding
from pjit_ppo.models import heads


def copy_fn(dtype=None):
    """tree -> a copy of every leaf, floating ones cast to `dtype` (None: kept); the
    function `_copy` jits (and the planner traces for its shapes)."""
    dtype = None if dtype is None else jnp.dtype(dtype)

    def cast(x):
        return x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) \
            else x
    return lambda tree: jax.tree.map(lambda x: jnp.copy(cast(x)), tree)


def _copy(tree, dtype=None):
    """A jitted copy (new buffers, same shardings), optionally cast to `dtype`.

    New buffers matter: the train state is donated every update, so a frozen
    model must never share buffers with a trainable one.
    """
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.jit(copy_fn(dtype), out_shardings=shardings)(tree)


def trunk_only(lm_params: dict) -> dict:
    """The LM tree without its (untied) LM head and any scalar heads."""
    return {k: v for k, v in lm_params.items()
            if k != "lm_head" and not k.endswith("_head")}


def make_critic(trunk_params: dict, d_model: int, mesh=None) -> dict:
    """Critic params: a copy of `trunk_params`' trunk plus a zero-initialised value head."""
    critic = _copy(trunk_only(trunk_params))
    head = heads.init_value_head(d_model)
    if mesh is not None:
        head = jax.device_put(head, sharding.replicated(mesh))
    critic.update(head)
    return critic


def make_frozen(params: dict, compute_dtype: str) -> dict:
    """A frozen inference copy of a model (the reference policy, the reward model):
    new buffers in the compute dtype, no optimizer state."""
    return _copy(params, jnp.dtype(compute_dtype))
