"""reward.kind="target_tokens": the fraction of a response's tokens that are in
reward.target_ids (the CPU demo's and the learning tests' reward).

It needs no trained model and its optimum is known (always emit target tokens), so
learning is measurable. No frozen parameters, no trunk for a critic, no FLOPs.
"""
from __future__ import annotations

from typing import Sequence

from pjit_ppo.errors import ConfigError
from pjit_ppo.rewards.kind import Reward, RewardKind


def target_token_reward(target_ids: Sequence[int]):
    """The RewardFn: score = fraction of the (truncated) response's real tokens that are
    in target_ids, float32 [B] in [0, 1]; reward_params are ignored (pass None)."""
    import jax.numpy as jnp
    targets = jnp.asarray(list(target_ids), jnp.int32)

    def fn(reward_params, query, query_mask, response, response_mask):
        del reward_params, query, query_mask
        hit = jnp.any(response[..., None] == targets, axis=-1) & response_mask
        n = jnp.maximum(jnp.sum(response_mask, axis=-1), 1)
        return jnp.sum(hit, axis=-1).astype(jnp.float32) / n

    fn.program_key = f"target_tokens {tuple(int(t) for t in target_ids)}"  # program_cache
    return fn


def check(options) -> None:
    """reward.target_ids: a non-empty tuple of token ids (ints >= 0)."""
    if len(options.target_ids) == 0:
        raise ConfigError("reward.target_ids is empty: list the token ids the target_tokens "
                          "reward counts")
    for i, token in enumerate(options.target_ids):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ConfigError(f"reward.target_ids[{i}]={token!r} must be an integer >= 0 "
                              f"(a token id)")


def models(config):
    """No model: the reward is a function of the tokens."""
    del config
    return ()


def check_fit(config, policy, reward_models) -> None:
    """Every target id is a token of the policy's vocabulary."""
    vocab = policy.vocab_size
    bad = [t for t in config.reward.target_ids if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"reward.target_ids={tuple(config.reward.target_ids)}: {bad} outside "
                          f"the policy's vocabulary [0, {vocab}); list token ids the policy "
                          f"can emit")


def flops(config, model) -> float:
    """A comparison per token: no model FLOPs."""
    return 0.0


def build(config, make) -> Reward:
    """The RewardFn alone (`make` is not needed: there are no parameters)."""
    return Reward(fn=target_token_reward(tuple(config.reward.target_ids)), params=None,
                  model=None, trunk=None, flops=flops(config, None))


def describe(config) -> str:
    return f"target_tokens {list(config.reward.target_ids)}"


KIND = RewardKind(name="target_tokens", check=check, models=models, check_fit=check_fit,
                  build=build, flops=flops, describe=describe, critic_trunk=False,
                  term_arg="target_ids")
