"""The reward model: a decoder trunk + reward head scoring the N responses of a query,
and its directory on disk.

A reward-model directory (what `reward_learning.train` writes and PPO's
`reward.path` points at):

  config.json, model.safetensors   an HF causal-LM directory (`save_pretrained`): the
                                   trained trunk, and the LM head of the model it started
                                   from (unused by the reward; kept so that
                                   `load_pretrained` and transformers load the directory)
  reward_head.safetensors          the head: w [d_model], b, gain, bias (float32)
                                   (`pjit_ppo.models.heads.REWARD_HEAD_FILE`); the reward
                                   is gain * (h_last . w + b) + bias
  reward_model.json                how it was made: sequence shapes, pad id, the
                                   normalisation measured, held-out accuracy
  tokenizer files                  copied from the tokenizer used for the labels
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from pjit_ppo import sharding
from pjit_ppo.models import heads, load_pretrained, save_pretrained
from pjit_ppo.models.config import ModelConfig
from pjit_ppo.models import scoring

#: Metadata file of a reward-model directory.
REWARD_MODEL_INFO = "reward_model.json"


def reward_scores(model_cfg: ModelConfig, params, query: jax.Array, query_mask: jax.Array,
                  responses: jax.Array, response_mask: jax.Array) -> jax.Array:
    """Rewards of N responses per query, each scored at its last real token.

    Args:
      params: trunk + {"reward_head"}.
      query: int32 [B, Q] left-padded; query_mask bool [B, Q].
      responses: int32 [B, N, R] right-padded; response_mask bool [B, N, R].
    Returns:
      float32 [B, N] = gain * (h . w + b) + bias at the last real token of each
      query + response (the same score PPO's reward function gives).
    """
    b, n, r = responses.shape
    qm = jnp.repeat(query_mask.astype(bool), n, axis=0)
    q = jnp.where(qm, jnp.repeat(query, n, axis=0), 0)  # pad ids may lie outside the vocab
    rm = response_mask.reshape(b * n, r).astype(bool)
    resp = jnp.where(rm, responses.reshape(b * n, r), 0)
    return scoring.sequence_reward(model_cfg, params, q, qm, resp, rm).reshape(b, n)


def split_lm(lm_params: Mapping[str, Any]) -> Tuple[dict, dict]:
    """(trunk, rest): the LM tree without its LM head, and the LM head alone (maybe {})."""
    trunk = {k: v for k, v in lm_params.items() if k != "lm_head"}
    rest = {k: v for k, v in lm_params.items() if k == "lm_head"}
    return trunk, rest


def save_reward_model(directory: str, model_cfg: ModelConfig, params, lm_head: dict,
                      info: Dict[str, Any], dtype: Optional[str] = None) -> str:
    """Writes a reward-model directory (see the module docstring); returns it.

    params: trunk + {"reward_head"}; lm_head: the {"lm_head": ...} of the starting
    LM ({} for a tied head). The tokenizer files are the caller's to copy.
    """
    lm = {k: v for k, v in params.items() if k != "reward_head"}
    lm.update(lm_head)
    save_pretrained(directory, model_cfg, lm, dtype=dtype)
    heads.save_reward_head(directory, params)
    if jax.process_index() == 0:
        path = os.path.join(directory, REWARD_MODEL_INFO)
        with open(path + ".tmp", "w") as f:
            json.dump(info, f, indent=2, sort_keys=True, default=str)
        os.replace(path + ".tmp", path)
    return directory


def load_reward_model(directory: str, mesh=None, dtype: str = "float32",
                      config_overrides: Optional[Mapping[str, Any]] = None):
    """(ModelConfig, trunk + {"reward_head"} params) from a reward-model directory.

    The trunk is sharded on `mesh` by the default partition rules (first device when
    None), the head replicated. Raises FileNotFoundError when the directory has no
    reward head (a plain LM directory).
    """
    cfg, lm = load_pretrained(directory, mesh=mesh, dtype=dtype,
                              config_overrides=config_overrides)
    head = heads.load_reward_head(directory, cfg.d_model)
    if head is None:
        raise FileNotFoundError(f"{directory}: no {heads.REWARD_HEAD_FILE}; it is an LM "
                                f"directory, not a trained reward model")
    params, _ = split_lm(lm)
    put = (sharding.replicated(mesh) if mesh is not None
           else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    params.update(jax.device_put(head, put))
    return cfg, params
