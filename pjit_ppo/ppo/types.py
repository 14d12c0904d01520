"""The types the PPO phases pass between them (shared by collection, estimators, update)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax

from pjit_ppo.models.config import ModelConfig
from pjit_ppo.models.lora import without_adapters
from pjit_ppo.rewards import RewardFn, host_functions

#: iteration -> (query int32 [B, Q] left-padded global array, query_mask bool [B, Q]).
PromptFn = Callable[[int], Tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class PPOModels:
    """Static description of the models of a run (hashable, closed over by jit).

    policy: the policy's (and reference's) architecture.
    critic: the separate critic's architecture; None with a shared trunk or a
      critic-free estimator (ppo.advantage_estimator "grpo", "rloo", "reinforce_pp").
    reward_fn: scores (query, truncated response); `rewards.model_reward_fn(config)`
      gives the reward-model one; tests and demos may pass any function of tokens. A
      reward with Python functions (`rewards.host_functions(reward_fn)` non-empty)
      splits the rollout: sampling, the functions on the host, then scoring.
    critic_base: with a LoRA critic (its ModelConfig has `lora`), where its frozen trunk
      is in the frozen models: ("ref",) the policy's base, ("reward",) or ("reward",
      term) the reward model's; None otherwise. With LoRA on the policy (policy.lora),
      params["policy"] are adapters on frozen["ref"] (`pjit_ppo.ppo.lora_views`).
    """
    policy: ModelConfig
    critic: Optional[ModelConfig]
    reward_fn: RewardFn
    critic_base: Optional[Tuple[str, ...]] = None

    @property
    def reference(self) -> ModelConfig:
        """The reference's architecture: the policy's without adapters (the reference is
        the initial policy: with LoRA, the base the adapters sit on)."""
        return without_adapters(self.policy)

    @property
    def host_reward_columns(self) -> int:
        """How many Python reward functions run on the host (0: one rollout program)."""
        return len(host_functions(self.reward_fn))


class Sampled(NamedTuple):
    """What the sampling program of a split rollout gives the host and the scoring program
    (every field [B, R], sharded over the batch; B = ppo.batch_size episodes)."""
    response: jax.Array   # int32, raw sampled tokens
    logprobs: jax.Array   # float32, the sampler's log-probs (temperature-scaled)
    kept: jax.Array       # bool, the positions the reward sees (up to the stop token)


class Experience(NamedTuple):
    """What collection produces: sampled episodes and their scores, before any estimator.

    Every field is [B, ...], sharded over the batch; B = ppo.batch_size episodes, the
    ppo.samples_per_prompt samples of a prompt in contiguous rows.
    """
    query: jax.Array          # int32 [B, Q], left-padded
    query_mask: jax.Array     # bool [B, Q]
    response: jax.Array       # int32 [B, R], raw sampled tokens (PPO trains on these)
    logprobs: jax.Array       # float32 [B, R], policy at sampling time (temperature-scaled)
    ref_logprobs: jax.Array   # float32 [B, R], frozen reference policy
    values: Optional[jax.Array]  # float32 [B, R], critic at sampling time; None without one
    scores: jax.Array         # float32 [B], reward of the truncated response (penalty applied)
    mask: Optional[jax.Array] = None  # bool [B, R], the tokens that count (up to and including
    #                                   the stop token); None = every token (the "gae" rule)


class RolloutBatch(NamedTuple):
    """What the update trains on; every field is [B, ...], sharded over the batch.

    Fields an estimator does not use are None (no buffer, nothing to shard): values
    and returns without a critic, mask with every token counting ("gae"),
    ref_logprobs unless the loss has a KL term ("grpo").
    """
    query: jax.Array        # int32 [B, Q], left-padded
    query_mask: jax.Array   # bool [B, Q]
    response: jax.Array     # int32 [B, R], raw sampled tokens
    logprobs: jax.Array     # float32 [B, R], policy at sampling time
    values: Optional[jax.Array]   # float32 [B, R], critic at sampling time
    advantages: jax.Array   # float32 [B, R], from the configured estimator
    returns: Optional[jax.Array]  # float32 [B, R], value targets
    mask: Optional[jax.Array] = None          # bool [B, R], tokens the loss counts
    ref_logprobs: Optional[jax.Array] = None  # float32 [B, R], frozen reference policy
    scores: Optional[jax.Array] = None  # float32 [B], the reward of each episode (for sample
    #                                     tables; the update does not read it)


class TrainState(NamedTuple):
    """Everything that changes during training (what a checkpoint must hold).

    params: {"policy": ..., "critic": ...} or {"policy": ..., "value_head": ...}, or
      {"policy": ...} with a critic-free estimator.
    opt_state: optax state, sharded like params.
    kl_coef: float32 scalar.
    iteration: int32 scalar, number of completed PPO iterations.
    """
    params: Any
    opt_state: Any
    kl_coef: jax.Array
    iteration: jax.Array
