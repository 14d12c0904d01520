"""The types the PPO phases pass between them (shared by collection, estimators, update)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax

from pjit_ppo.models.config import ModelConfig

#: (reward_params, query [B,Q], query_mask [B,Q], response [B,R], response_mask [B,R])
#: -> float32 scores [B]. Scores the truncated response.
RewardFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]

#: iteration -> (query int32 [B, Q] left-padded global array, query_mask bool [B, Q]).
PromptFn = Callable[[int], Tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class PPOModels:
    """Static description of the models of a run (hashable, closed over by jit).

    policy: the policy's (and reference's) architecture.
    critic: the separate critic's architecture; None with a shared trunk.
    reward_fn: scores (query, truncated response); `rewards.model_reward_fn(config)`
      gives the reward-model one; tests and demos may pass any function of tokens.
    """
    policy: ModelConfig
    critic: Optional[ModelConfig]
    reward_fn: RewardFn


class Experience(NamedTuple):
    """What collection produces: sampled episodes and their scores, before any estimator.

    Every field is [B, ...], sharded over the batch.
    """
    query: jax.Array          # int32 [B, Q], left-padded
    query_mask: jax.Array     # bool [B, Q]
    response: jax.Array       # int32 [B, R], raw sampled tokens (PPO trains on these)
    logprobs: jax.Array       # float32 [B, R], policy at sampling time (temperature-scaled)
    ref_logprobs: jax.Array   # float32 [B, R], frozen reference policy
    values: jax.Array         # float32 [B, R], critic at sampling time
    scores: jax.Array         # float32 [B], reward of the truncated response (penalty applied)


class RolloutBatch(NamedTuple):
    """What the update trains on; every field is [B, ...], sharded over the batch."""
    query: jax.Array        # int32 [B, Q], left-padded
    query_mask: jax.Array   # bool [B, Q]
    response: jax.Array     # int32 [B, R], raw sampled tokens
    logprobs: jax.Array     # float32 [B, R], policy at sampling time
    values: jax.Array       # float32 [B, R], critic at sampling time
    advantages: jax.Array   # float32 [B, R], from the configured estimator
    returns: jax.Array      # float32 [B, R], value targets


class TrainState(NamedTuple):
    """Everything that changes during training (what a checkpoint must hold).

    params: {"policy": ..., "critic": ...} or {"policy": ..., "value_head": ...}.
    opt_state: optax state, sharded like params.
    kl_coef: float32 scalar.
    iteration: int32 scalar, number of completed PPO iterations.
    """
    params: Any
    opt_state: Any
    kl_coef: jax.Array
    iteration: jax.Array
