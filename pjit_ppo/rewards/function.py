"""reward.kind="function": a reward written in Python, `reward.function=SPEC`.

SPEC is `package.module:callable` or `path/to/file.py:callable` (`pjit_ppo.rewards.spec`);
the callable is `fn(prompts: list[str], responses: list[str], **metadata) -> sequence of
float`, one score per row (`pjit_ppo.rewards.host` has the whole contract; ready-made
ones are in `pjit_ppo.rewards.functions`, e.g. `pjit_ppo.rewards.functions:exact_match`).

It runs on the host, so the rollout is split (`pjit_ppo.ppo.trainer`): a compiled
sampling program, then each process decodes its own rows and calls the function once
per rollout micro-batch (`time/reward_s`), then a compiled program for everything after
(log-probs, values, KL, the estimator) that reads the scores as `host_scores`. The
prompts must be text (data.prompts_path): the function reads text. No device
parameters, no trunk for a critic, no FLOPs.

Like every kind, this is one module defining `KIND = RewardKind(...)` plus one line in
`pjit_ppo.rewards.registry.KINDS`; a kind whose scores come from the host returns a
RewardFn that reads `host_scores` and carries its `host_functions` (as `HostScores`).
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

from pjit_ppo.errors import ConfigError
from pjit_ppo.rewards import spec as spec_lib
from pjit_ppo.rewards.host import HostFunction
from pjit_ppo.rewards.kind import Reward, RewardKind

FIELD = "reward.function"


@dataclasses.dataclass(frozen=True, eq=False)
class HostScores:
    """The RewardFn of Python functions run on the host: their scores, computed before the
    scoring program, arrive as its `host_scores` input (one column per function)."""
    host_functions: Tuple[HostFunction, ...]

    def __call__(self, reward_params, query, query_mask, response, response_mask,
                 host_scores=None):
        """host_scores float32 [B, H] -> float32 [B] (the first column; H = 1)."""
        del reward_params, query, query_mask, response, response_mask
        if host_scores is None:
            names = ", ".join(f.spec for f in self.host_functions)
            raise ValueError(f"the reward function {names} runs on the host: its scores come in "
                             f"as host_scores (float32 [B, {len(self.host_functions)}]); "
                             f"score the decoded responses with pjit_ppo.rewards.HostScorer "
                             f"first")
        return host_scores[:, 0]

    @property
    def program_key(self) -> str:
        """What the traced part depends on (`pjit_ppo.program_cache`): the first column of
        host_scores; the functions themselves run on the host."""
        return f"host_scores {len(self.host_functions)}"


def check(options) -> None:
    """reward.function: a SPEC of either form (not imported here: the launch does that)."""
    spec_lib.parse(options.function, FIELD)


def models(config):
    """No model: the function reads text."""
    del config
    return ()


def check_fit(config, policy, reward_models) -> None:
    """The function reads text: the prompts must come from a file and a tokenizer."""
    del policy, reward_models
    if not config.data.prompts_path:
        raise ConfigError(f"{FIELD}={config.reward.function!r} scores text, and "
                          f"data.prompts_path is empty (random token prompts have no text): "
                          f"give a JSONL, text or HF dataset of prompts and a tokenizer")


def flops(config, model) -> float:
    """Runs on the host: no device FLOPs."""
    return 0.0


def build(config, make) -> Reward:
    """The host-scored RewardFn (the function is imported on its first call)."""
    del make
    fn = HostScores((HostFunction(config.reward.function, FIELD),))
    return Reward(fn=fn, params=None, model=None, trunk=None, flops=0.0)


def describe(config) -> str:
    return f"the Python function {config.reward.function}"


def functions(config):
    return ((FIELD, config.reward.function),)


KIND = RewardKind(name="function", check=check, models=models, check_fit=check_fit,
                  build=build, flops=flops, describe=describe, critic_trunk=False,
                  term_arg="function", functions=functions)
