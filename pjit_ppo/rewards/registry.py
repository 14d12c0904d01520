"""The reward kinds by name: the one place `reward.kind` is dispatched.

The config (kind names, option checks, whether ppo.critic_init="reward" can work),
the pre-flight (model paths, shapes), the PPO build, the planner, evaluation and the
checkpoints' record of the frozen models all ask this registry. Adding a kind is one
new module in `pjit_ppo/rewards/` that defines `KIND = RewardKind(...)`
(`pjit_ppo.rewards.kind` says what each function must do) plus one line in `KINDS`.
jax-free (the launch pre-flight imports it before jax).
"""
from __future__ import annotations

from typing import Dict, Tuple

from pjit_ppo.errors import ConfigError
from pjit_ppo.rewards import function, model, target_tokens, terms
from pjit_ppo.rewards.kind import Reward, RewardKind

#: reward.kind -> the kind.
KINDS: Dict[str, RewardKind] = {
    "model": model.KIND,
    "target_tokens": target_tokens.KIND,
    "function": function.KIND,
}
KINDS["terms"] = terms.over(KINDS)  # weighted terms of the kinds above


def get(name: str) -> RewardKind:
    """The kind registered under `name`; ConfigError naming the choices otherwise."""
    if name not in KINDS:
        raise ConfigError(f"reward.kind={name!r}; choose one of {', '.join(map(repr, KINDS))}")
    return KINDS[name]


def check(options) -> None:
    """The `reward` section's kind and the kind's own options (jax-free); ConfigError.

    reward.function and reward.terms are refused with a kind that would ignore them (a
    run that silently trains on another reward)."""
    get(options.kind)
    if getattr(options, "terms", ()) and options.kind != "terms":
        raise ConfigError(f"reward.terms is set but reward.kind={options.kind!r} ignores it: "
                          f"set reward.kind='terms' to combine the terms")
    if getattr(options, "function", "") and options.kind not in ("function", "terms"):
        raise ConfigError(f"reward.function={options.function!r} is set but "
                          f"reward.kind={options.kind!r} ignores it: set "
                          f"reward.kind='function'")
    get(options.kind).check(options)


def function_specs(config) -> Tuple[Tuple[str, str], ...]:
    """(config field, SPEC) of every Python reward function the run calls on the host."""
    return get(config.reward.kind).functions(config)


def critic_trunk_kinds() -> Tuple[str, ...]:
    """The kinds whose build gives a trunk a critic can start from."""
    return tuple(name for name, kind in KINDS.items() if kind.critic_trunk)


def build(config, make) -> Reward:
    """The run's reward (`config.reward`), with `make`'s parameters (real or abstract)."""
    return get(config.reward.kind).build(config, make)


def describe(config) -> str:
    """Where the run's frozen reward parameters come from (for checkpoints)."""
    return get(config.reward.kind).describe(config)
