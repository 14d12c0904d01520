"""reward.kind="model": a learned reward model, a decoder trunk + a scalar reward head
scored at the last real token of query + response.

reward.path is a reward-model directory (`pjit_ppo.models.reward_model`, what the
reward-learning stage writes): its trained head, with the normalisation's gain and
bias, is used. "" = the policy's starting point (model.policy_path, or random init
from model.random with seed ppo.seed + 1) with a random head N(0, 1/sqrt(d + 1)) from
reward.head_seed: a smoke-test reward, logged as a warning. A directory without a
trained head is refused unless reward.allow_random_head=True (then also a random head
and a warning): a plain language model is not a reward model.
The frozen copy is stored in the compute dtype; the fp32 trunk + head is what a
critic starts from with ppo.critic_init="reward".
"""
from __future__ import annotations

import os

from pjit_ppo.errors import ConfigError
from pjit_ppo.rewards.kind import Reward, RewardKind

#: Where the trunk comes from, as checkpoints record it when it is random.
_RANDOM_TRUNK = "random init (ppo.seed + 1, model.random)"
#: The trained head of a reward-model directory (`pjit_ppo.models.heads.REWARD_HEAD_FILE`;
#: spelt here so the pre-flight reads it without importing the models).
_HEAD_FILE = "reward_head.safetensors"


def trunk_path(config) -> str:
    """The directory the reward trunk is read from: reward.path, else the policy's
    (model.policy_path; "" = random init from model.random)."""
    return config.reward.path or config.model.policy_path


def has_trained_head(path: str) -> bool:
    """Whether `path` is a reward-model directory (it holds a trained reward head)."""
    return bool(path) and os.path.isfile(os.path.join(path, _HEAD_FILE))


def _check_head(config) -> None:
    path = config.reward.path
    if path and not has_trained_head(path) and not config.reward.allow_random_head:
        raise ConfigError(
            f"reward.path={path!r} has no {_HEAD_FILE}: it is a language model, not a reward "
            f"model, and its score would come from a random head. Train a reward model with "
            f"pjit-ppo-reward (configs/hf_reward.py) and point reward.path at its "
            f"reward_model/ directory, or set reward.allow_random_head=True for a smoke test")


def model_reward_fn(reward_config):
    """The RewardFn of a reward model with architecture `reward_config` (a ModelConfig):
    its score at the last real token of query + response, float32 [B]."""
    from pjit_ppo.models import scoring

    def fn(reward_params, query, query_mask, response, response_mask):
        return scoring.sequence_reward(reward_config, reward_params, query, query_mask,
                                       response, response_mask)
    fn.program_key = f"model {reward_config!r}"  # what it traces (pjit_ppo.program_cache)
    return fn


def check(options) -> None:
    """Nothing beyond the shared fields: reward.path is checked with the models."""


def models(config):
    """The reward model's trunk: reward.path, else the policy's (see `trunk_path`)."""
    field = "reward.path" if config.reward.path else "model.policy_path"
    return ((field, trunk_path(config)),)


def check_fit(config, policy, reward_models) -> None:
    """A directory without a trained head is refused unless asked for; the reward model
    reads every token the policy can sample."""
    _check_head(config)
    (reward,) = reward_models
    if reward.vocab_size < policy.vocab_size:
        raise ConfigError(f"reward.path={config.reward.path!r}: the reward model's vocabulary "
                          f"({reward.vocab_size}) is smaller than the policy's "
                          f"({policy.vocab_size}), so it cannot read every sampled token; use "
                          f"a reward model trained on the policy's tokenizer")


def flops(config, model) -> float:
    """One forward pass over query + response; the last layer only at the R + 1
    positions the score can be read from."""
    from pjit_ppo.flops import forward_flops
    q, r = config.ppo.query_length, config.ppo.response_length
    return forward_flops(model, q + r, q + r, 0, last_layer_tokens=r + 1)


def _head(path: str, d_model: int, head_seed: int) -> dict:
    """{"reward_head": ...}: reward.path's trained head, else a random one."""
    import jax
    from pjit_ppo.models import heads
    head = heads.load_reward_head(path, d_model) if path else None
    return head if head is not None else heads.init_reward_head(
        d_model, jax.random.PRNGKey(head_seed))


def build(config, make) -> Reward:
    """The trunk of reward.path (fp32, sharded) + its head (replicated); the frozen copy
    in the compute dtype."""
    from absl import logging
    from pjit_ppo.models import assemble
    options = config.reward
    _check_head(config)
    if not has_trained_head(options.path):
        logging.warning("reward: %s; the scores mean nothing (a smoke test). Point "
                        "reward.path at a reward model from pjit-ppo-reward to learn from "
                        "preferences", describe(config))
    model_cfg, lm = make.lm(config.model, trunk_path(config), config.ppo.seed + 1)
    trunk = assemble.trunk_only(lm)
    trunk.update(make.replicated(lambda: _head(options.path, model_cfg.d_model,
                                               options.head_seed)))
    return Reward(fn=model_reward_fn(model_cfg),
                  params=make.copy(trunk, model_cfg.compute_dtype),
                  model=model_cfg, trunk=trunk, flops=flops(config, model_cfg))


def describe(config) -> str:
    path = config.reward.path
    if has_trained_head(path):
        return f"{path} (a trained reward model: trunk + its reward head)"
    trunk = trunk_path(config) or _RANDOM_TRUNK
    return f"{trunk} + a random reward head (reward.head_seed={config.reward.head_seed})"


KIND = RewardKind(name="model", check=check, models=models, check_fit=check_fit,
                  build=build, flops=flops, describe=describe, critic_trunk=True,
                  term_arg="path")
