"""What a reward kind is: the interface each module of `pjit_ppo.rewards` fills in.

A reward kind (`reward.kind`) is one module that builds a `RewardKind` from its own
functions; `pjit_ppo.rewards.registry` maps the kind's name to it. This module, the
registry and every kind module import no jax at module level: the config check and
the pre-flight (`pjit_ppo.preflight`) run before jax is imported, so a kind imports
jax (and the models) inside the functions that need it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Tuple


def _no_functions(config) -> Tuple[Tuple[str, str], ...]:
    del config
    return ()


class Reward(NamedTuple):
    """A built reward: what a run scores its responses with.

    fn: a RewardFn (`pjit_ppo.rewards.responses.RewardFn`): (params, query int32 [B, Q],
      query_mask bool [B, Q], response int32 [B, R] (truncated), response_mask bool
      [B, R]) -> float32 scores [B]. A reward with Python functions run on the host
      (`pjit_ppo.rewards.host`) gives a fn that also takes `host_scores` float32
      [B, H] (the functions' scores, one column each) and carries the functions as
      `fn.host_functions` (`pjit_ppo.rewards.host_functions(fn)`); a reward of several
      weighted terms (`pjit_ppo.rewards.terms`) gives a fn with `names` and
      `terms(...) -> float32 [B, T]` (each term's own score). Each built-in kind's fn
      has `program_key`, a string naming everything its traced code closes over (its
      ModelConfig, target ids, weights): with it, a run's compiled PPO phases may come
      from `pjit_ppo.program_cache`; a fn without one is always traced.
    params: the frozen parameters `fn` reads (a pytree in the compute dtype, sharded
      on the mesh; or jax.ShapeDtypeStructs with shardings when built abstractly),
      or None when it reads none.
    model: the architecture (`ModelConfig`) of the model `fn` runs, or None.
    trunk: the fp32 trunk + reward head of that model, the critic's starting point
      with ppo.critic_init="reward"; None when the kind has none (`critic_trunk`).
    flops: forward FLOPs of scoring one episode (query_length + response_length
      tokens), for MFU; 0 for a function of tokens.
    """
    fn: Callable
    params: Any
    model: Optional[Any]
    trunk: Optional[dict]
    flops: float


@dataclasses.dataclass(frozen=True)
class RewardKind:
    """One reward kind: the functions the config, the pre-flight, the build, the planner
    and the checkpoints ask of it. `config` is the run config (its `reward` section
    holds the kind's options), `options` that section alone.

    name: the value of reward.kind.
    check(options): the options' own values (jax-free); raises ConfigError naming the
      field, the value and the fix. The kind's name is checked by the registry.
    models(config) -> ((field, path), ...): the language models the reward runs, each
      named by its config field and its directory ("" = random init from
      model.random). The pre-flight reads their config.json and safetensors headers
      and checks their shapes against the mesh and the sequence length.
    check_fit(config, policy, models): the options against the shapes (jax-free):
      `policy` the policy's ModelConfig, `models` the ModelConfigs of `models(options)`
      in order. Raises ConfigError.
    build(config, make) -> Reward: the reward on `make`'s mesh. `make` is a
      `pjit_ppo.param_makers` maker: real arrays for a run, abstract shapes with
      shardings for the planner (the same code path, so the plan cannot drift).
    flops(config, model) -> float: forward FLOPs of scoring one episode (`model`: the
      Reward's model or None); `build` fills Reward.flops with it.
    describe(config) -> str: where the frozen parameters come from (written into each
      checkpoint's run/ JSON instead of the weights).
    critic_trunk: whether `build` can return a trunk the critic may start from
      (ppo.critic_init="reward" is refused for kinds without one).
    term_arg: the field of the `reward` section that the optional fourth part of a
      `reward.terms` entry ("name:kind:weight:ARG") sets for a term of this kind
      (e.g. "path", "function"); None when a term of this kind takes no argument.
    functions(config) -> ((field, SPEC), ...): the Python reward functions the reward
      calls on the host, each named by the config field that gives its SPEC; the
      launch pre-flight imports and calls each once on a dry batch. () for kinds
      computed on the devices.
    """
    name: str
    check: Callable[[Any], None]
    models: Callable[[Any], Tuple[Tuple[str, str], ...]]
    check_fit: Callable[[Any, Any, Tuple[Any, ...]], None]
    build: Callable[[Any, Any], Reward]
    flops: Callable[[Any, Optional[Any]], float]
    describe: Callable[[Any], str]
    critic_trunk: bool = False
    term_arg: Optional[str] = None
    functions: Callable[[Any], Tuple[Tuple[str, str], ...]] = _no_functions
