"""Rewards PPO trains against, one module per kind (`reward.kind`), and the rules that
score sampled responses; stage-neutral (no stage imported here).

  kind.py           RewardKind (what a kind module provides) and Reward (what it builds)
  registry.py       KINDS: reward.kind -> RewardKind, the one place the kind is dispatched
  model.py          "model": a learned reward model (reward-model dir, or LM + random head)
  target_tokens.py  "target_tokens": the fraction of target tokens (the demo's reward)
  function.py       "function": a Python function of the decoded texts (reward.function)
  terms.py          "terms": several kinds combined with weights (reward.terms)
  host.py           HostFunction (the contract and its one-line errors), HostScorer
  spec.py           SPEC strings (`package.module:callable`, `file.py:callable`)
  functions.py      built-in reward functions (exact match, format check, length penalty)
  responses.py      RewardFn, truncate_responses, score_responses (truncate, score,
                    penalise a missing stop)

A new kind is one new module defining `KIND = RewardKind(...)` and one line in
`registry.KINDS`. Importing this package does not import jax (the config and the
pre-flight use the registry before jax starts); the jax-side names below load on
first use.
"""
import importlib

from pjit_ppo.rewards.host import HostFunction, HostScorer, host_functions
from pjit_ppo.rewards.kind import Reward, RewardKind
from pjit_ppo.rewards.model import model_reward_fn
from pjit_ppo.rewards.registry import KINDS, build, check, describe, function_specs, get
from pjit_ppo.rewards.spec import RewardFunctionError
from pjit_ppo.rewards.target_tokens import target_token_reward

#: name -> the module that defines it (imported on first use: these need jax).
_LAZY = {
    "RewardFn": "pjit_ppo.rewards.responses",
    "score_responses": "pjit_ppo.rewards.responses",
    "truncate_responses": "pjit_ppo.rewards.responses",
}

__all__ = ["Reward", "RewardKind", "KINDS", "build", "check", "describe", "function_specs",
           "get", "model_reward_fn", "target_token_reward", "HostFunction", "HostScorer",
           "host_functions", "RewardFunctionError", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pjit_ppo.rewards' has no attribute {name!r}")
