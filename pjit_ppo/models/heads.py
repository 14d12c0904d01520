"""Scalar heads over the trunk's final hidden states: value (critic) and reward.

Parameters are plain Haiku-style dicts so they merge into a model's tree:

  value_head   w [d_model] (zeros), b [] (zero)                  (lm-human-preferences' init)
  reward_head  w [d_model] ~ N(0, 1/sqrt(d_model + 1)), b [] = 0,
               gain [] = 1, bias [] = 0   (reward = gain * (h.w + b) + bias)

A trained reward head is stored beside its trunk's HF directory as
REWARD_HEAD_FILE (safetensors, float32 tensors w [d_model], b [1], gain [1], bias [1]:
the scalars as 1-element vectors); `save_reward_head` / `load_reward_head` write and
read it.
"""
from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

#: The reward head's file in a reward-model directory.
REWARD_HEAD_FILE = "reward_head.safetensors"
_REWARD_HEAD_KEYS = ("w", "b", "gain", "bias")


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


def save_reward_head(directory: str, params: dict) -> str:
    """Writes params["reward_head"] to directory/REWARD_HEAD_FILE (float32); returns the path."""
    from pjit_ppo.models.safetensors_io import write_safetensors
    head = {k: np.asarray(jax.device_get(params["reward_head"][k]), np.float32).reshape(-1)
            for k in _REWARD_HEAD_KEYS}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, REWARD_HEAD_FILE)
    write_safetensors(path + ".tmp", [(k, v.shape, np.float32) for k, v in head.items()],
                      head.__getitem__, {"format": "pjit_ppo.reward_head"})
    os.replace(path + ".tmp", path)
    return path


def load_reward_head(directory: str, d_model: int) -> Optional[dict]:
    """{"reward_head": {w [d_model], b [], gain [], bias []}} (float32 numpy) from
    directory/REWARD_HEAD_FILE, or None when the directory has no such file.

    Raises ValueError naming the file when a tensor is missing or has the wrong shape.
    """
    from pjit_ppo.models.safetensors_io import read_header
    path = os.path.join(directory, REWARD_HEAD_FILE)
    if not os.path.isfile(path):
        return None
    infos = read_header(path)
    head = {}
    for key in _REWARD_HEAD_KEYS:
        want = (d_model,) if key == "w" else (1,)
        info = infos.get(key)
        if info is None or tuple(info.shape) != want or info.dtype != "F32":
            raise ValueError(f"{path}: tensor {key!r} must be float32 of shape {want}, found "
                             f"{None if info is None else (info.dtype, tuple(info.shape))}; "
                             f"is this reward head from a model with d_model={d_model}?")
        value = np.fromfile(path, np.float32, count=want[0], offset=info.offset)
        head[key] = value if key == "w" else value.reshape(())
    return {"reward_head": head}
