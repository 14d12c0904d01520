"""Reward normalisation (lm-human-preferences): rewards of the pretrained policy's own
samples get mean `target_mean` and std `target_std`, by setting the head's gain and bias.

`NormSampler.measure` samples responses to prompts with the policy (PPO's sampling
settings), truncates them after the stop token as a PPO rollout does, scores them
with the reward model and returns the mean and std; `normalized_head` turns those
into the new gain and bias. Each measurement (`round`) has its own prompts and
random draws, so a measurement after setting the head is on held-out samples.
"""
from __future__ import annotations

import functools
import zlib
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from pjit_ppo import padding, sampling, sharding, supervised
from pjit_ppo.models.reward_model import reward_scores


def normalized_head(head: dict, mean: float, std: float, target_mean: float = 0.0,
                    target_std: float = 1.0) -> dict:
    """The head {w, b, gain, bias} whose rewards r' = a * (r - mean) + target_mean,
    a = target_std / std: gain' = a * gain, bias' = a * (bias - mean) + target_mean."""
    if not np.isfinite(std) or std <= 0:
        raise FloatingPointError(f"reward std {std} over the normalisation samples: cannot "
                                 f"normalise (every sample got the same reward?)")
    a = target_std / std
    out = dict(head)
    out["gain"] = jnp.asarray(head["gain"], jnp.float32) * a
    out["bias"] = (jnp.asarray(head["bias"], jnp.float32) - mean) * a + target_mean
    return out


class NormSampler:
    """Samples (query, response) pairs from a frozen policy and scores them.

    Args:
      config: the RewardLearningConfig (sampling settings, norm_samples,
        norm_batch_size, pad_token_id, seed).
      policy_cfg, policy: the pretrained policy (any dtype, sharded on mesh).
      reward_cfg: the reward model's ModelConfig.
      queries: int32 [P, Q] left-padded prompts to draw from (pad = pad_token_id).
    """

    def __init__(self, config, policy_cfg, policy, reward_cfg, mesh, queries: np.ndarray):
        self.config, self.policy, self.mesh = config, policy, mesh
        self.queries = np.asarray(queries, np.int32)
        c = config
        pad = c.pad_token_id

        @functools.partial(jax.jit, out_shardings=sharding.replicated(mesh))
        def sample_and_score(policy, reward_params, query, key):
            query_mask = query != pad
            ids = jnp.where(query_mask, query, 0)
            response = sampling.generate(
                policy_cfg, policy, ids, query_mask, key, max_new_tokens=c.response_length,
                temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
                top_p_mode=c.top_p_mode, mesh=mesh)[0]
            if c.truncate_token is None:
                kept = jnp.ones(response.shape, bool)
            else:
                _, _, kept = padding.truncate_after_stop(response, c.truncate_token,
                                                         c.truncate_after, pad, with_mask=True)
            return reward_scores(reward_cfg, reward_params, query, query_mask,
                                 response[:, None], kept[:, None])[:, 0]
        self._sample_and_score = sample_and_score

    @functools.cached_property
    def _base_key(self) -> jax.Array:
        return jax.random.fold_in(jax.random.PRNGKey(self.config.seed),
                                  zlib.crc32(b"reward_normalization") & 0x7FFFFFFF)

    def rows(self) -> int:
        """Samples per measurement: norm_samples rounded up to whole norm_batch_size."""
        c = self.config
        return -(-c.norm_samples // c.norm_batch_size) * c.norm_batch_size

    def scores(self, reward_params, round_: int) -> np.ndarray:
        """float32 [rows()] rewards of fresh samples (prompts drawn for this round)."""
        c = self.config
        n, p = self.rows(), len(self.queries)
        draw = np.random.default_rng([c.seed, 7919, round_])
        index = draw.permutation(p)[:n] if n <= p else draw.integers(0, p, n)
        out = []
        for k, start in enumerate(range(0, n, c.norm_batch_size)):
            query = supervised.put_batch(self.mesh, self.queries[index[start:start +
                                                                       c.norm_batch_size]])
            key = jax.random.fold_in(jax.random.fold_in(self._base_key, round_), k)
            out.append(np.asarray(jax.device_get(
                self._sample_and_score(self.policy, reward_params, query, key))))
        return np.concatenate(out)

    def measure(self, reward_params, round_: int) -> Tuple[float, float]:
        """(mean, std) of `scores(reward_params, round_)` (population std)."""
        s = self.scores(reward_params, round_).astype(np.float64)
        return float(s.mean()), float(s.std())
