"""The model passes PPO makes on query+response sequences (policy, reference, critic, reward).

Queries are left-padded [B, Q] with a mask; responses are [B, R]. The logits that
predict response token t sit at sequence position Q - 1 + t, so the LM head is
applied to those R positions only (never to the query positions), and the last
layer of every model computes only positions Q - 1 onwards (`output_slice`).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from pjit_ppo import padding
from pjit_ppo.models import heads
from pjit_ppo.models.config import ModelConfig
from pjit_ppo.models.token_logprobs import head_token_logprobs
from pjit_ppo.models.transformer import hidden_states, lm_head_weights


def _sequence(query, query_mask, response, response_mask):
    ids = jnp.concatenate([query, response], axis=1)
    if response_mask is None:
        response_mask = jnp.ones(response.shape, bool)
    mask = jnp.concatenate([query_mask.astype(bool), response_mask.astype(bool)], axis=1)
    return ids, mask


def response_hidden(config: ModelConfig, params, query, query_mask, response,
                    response_mask=None) -> jax.Array:
    """Hidden states at the R positions that predict the response: [B, R, D]."""
    ids, mask = _sequence(query, query_mask, response, response_mask)
    q, r = query.shape[1], response.shape[1]
    return hidden_states(config, params, ids, mask, output_slice=(q - 1, q + r - 1))


def logprobs_from_hidden(config: ModelConfig, params, hidden, response, temperature: float,
                         with_entropy: bool = False):
    """Log-probabilities of `response` under logits / temperature.

    hidden: [B, R, D]; response: int32 [B, R]. Returns float32 logprobs [B, R] and,
    if with_entropy, the per-token entropy [B, R] of the same distribution. The
    temperature divides the float32 logits (also with a bf16 compute dtype).
    """
    weight, bias, vocab_major = lm_head_weights(config, params)
    logprobs, entropy = head_token_logprobs(hidden, weight, bias, response,
                                            vocab_major=vocab_major, scale=1.0 / temperature)
    return (logprobs, entropy) if with_entropy else logprobs


def response_logprobs(config: ModelConfig, params, query, query_mask, response,
                      temperature: float, response_mask: Optional[jax.Array] = None):
    """float32 [B, R] log-probabilities of the response tokens (temperature-scaled)."""
    hidden = response_hidden(config, params, query, query_mask, response, response_mask)
    return logprobs_from_hidden(config, params, hidden, response, temperature)


def response_values(config: ModelConfig, critic_params, query, query_mask, response,
                    response_mask=None) -> jax.Array:
    """Critic values at the positions that predict each response token: float32 [B, R]."""
    hidden = response_hidden(config, critic_params, query, query_mask, response, response_mask)
    return heads.value_from_hidden(critic_params, hidden)


def sequence_reward(config: ModelConfig, reward_params, query, query_mask, response,
                    response_mask) -> jax.Array:
    """Reward-model score of each (query, response) at its last real token: float32 [B].

    Hidden states are computed from position Q - 1 on (the last query token, real
    for any left-padded query that is not empty); a row with no real token there or
    after it is scored at position Q - 1.
    """
    ids, mask = _sequence(query, query_mask, response, response_mask)
    start = query.shape[1] - 1
    hidden = hidden_states(config, reward_params, ids, mask,
                           output_slice=(start, ids.shape[1]))
    last = jnp.maximum(padding.last_true_index(mask) - start, 0)
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return heads.reward_from_hidden(reward_params, h_last)


def policy_logprobs_and_values(cfg, models, params, query, query_mask, response,
                               with_entropy=False):
    """Policy logprobs (temperature-scaled) and critic values for a batch: [B, R] each.

    cfg: the PPOConfig (temperature, shared_trunk); models: the run's PPOModels;
    params: the trainable tree ({"policy", "critic"} or {"policy", "value_head"}).
    With `with_entropy`, also the per-token entropy [B, R] of the policy.
    """
    hidden = response_hidden(models.policy, params["policy"], query, query_mask, response)
    out = logprobs_from_hidden(models.policy, params["policy"], hidden, response,
                               cfg.temperature, with_entropy)
    if cfg.shared_trunk:
        values = heads.value_from_hidden(params, hidden)
    else:
        values = response_values(models.critic, params["critic"], query, query_mask, response)
    if with_entropy:
        return out[0], values, out[1]
    return out, values
