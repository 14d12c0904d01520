"""Scalar heads over the trunk's final hidden states: value (critic) and reward.

Parameters are plain Haiku-style dicts so they merge into a model's tree:

  value_head   w [d_model] (zeros), b [] (zero)                  (lm-human-preferences' init)
  reward_head  w [d_model] ~ N(0, 1/sqrt(d_model + 1)), b [] = 0,
               gain [] = 1, bias [] = 0   (reward = gain * (h.w + b) + bias)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def init_value_head(d_model: int) -> dict:
    """Zero-initialised value head: {"value_head": {"w": f32[d_model], "b": f32[]}}."""
    return {"value_head": {"w": jnp.zeros((d_model,), jnp.float32),
                           "b": jnp.zeros((), jnp.float32)}}


def init_reward_head(d_model: int, key: jax.Array) -> dict:
    """Reward head with w ~ N(0, 1/sqrt(d_model + 1)), zero bias, gain 1, offset 0."""
    w = jax.random.normal(key, (d_model,), jnp.float32) / jnp.sqrt(d_model + 1.0)
    return {"reward_head": {"w": w, "b": jnp.zeros((), jnp.float32),
                            "gain": jnp.ones((), jnp.float32),
                            "bias": jnp.zeros((), jnp.float32)}}


def value_from_hidden(params: dict, hidden: jax.Array) -> jax.Array:
    """Values for every position: hidden [..., d_model] -> float32 [...]."""
    head = params["value_head"]
    return jnp.einsum("...d,d->...", hidden.astype(jnp.float32), head["w"]) + head["b"]


def reward_from_hidden(params: dict, hidden: jax.Array) -> jax.Array:
    """Normalised reward: hidden [..., d_model] -> float32 [...] = gain * (h.w + b) + bias."""
    head = params["reward_head"]
    raw = jnp.einsum("...d,d->...", hidden.astype(jnp.float32), head["w"]) + head["b"]
    return head["gain"] * raw + head["bias"]

