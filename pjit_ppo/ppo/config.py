"""PPOConfig: every knob of policy learning, with the reference defaults (REFERENCE.md)."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Policy-learning hyperparameters. Defaults are those of lm-human-preferences.

    Sizes:
      query_length: prompt tokens (left-padded/truncated to this).
      response_length: sampled tokens per episode (always exactly this many).
      batch_size: episodes per PPO iteration, global over all devices/processes.
      nminibatches: optimizer steps per epoch (batch split into this many minibatches).
      noptepochs: passes over the batch per iteration, a fresh permutation each.
      gradient_accumulation_steps: micro-batches per minibatch (memory knob only).
      total_episodes: the run length; num_updates = total_episodes // batch_size.
    Sampling:
      temperature: divides logits when sampling *and* in every logprob (rollout,
        reference, loss).
      top_k (0 = off), top_p (1.0 = off).
    Post-processing:
      truncate_token: stop token id (GPT-2 '.' = 13); None disables truncation.
      truncate_after: truncation only counts stop tokens at index >= this.
      penalty_reward_value: score when no stop token occurs in
        [truncate_after, response_length).
    Losses / optimisation:
      cliprange, cliprange_value, vf_coef, gamma, lam, whiten_rewards.
      optimizer: "tf_adam" (eps on the uncorrected second moment) or "adam" (optax).
      lr, eps, anneal_lr (linear to 0 over updates, constant within one),
      max_grad_norm: global-norm clipping (None = off).
    KL:
      kl_controller: "adaptive" or "fixed"; init_kl_coef, kl_target, kl_horizon.
    Models:
      critic_init: "reward" (trunk of the reward model) or "policy".
      shared_trunk: value head on the policy trunk (no separate critic).
      recompute_rollout_logprobs: recompute old logprobs with a full forward after
        sampling (exact reference semantics) instead of using the sampler's.
    Misc:
      seed: base seed; iteration i uses fold_in(seed key, i).
      pad_token_id: pad id used for truncated responses and prompts.
    """

    query_length: int = 64
    response_length: int = 24
    batch_size: int = 512
    nminibatches: int = 1
    noptepochs: int = 4
    gradient_accumulation_steps: int = 1
    total_episodes: int = 1_000_000

    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0

    truncate_token: Optional[int] = 13
    truncate_after: int = 16
    penalty_reward_value: float = -1.0

    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = True

    optimizer: str = "tf_adam"
    lr: float = 1e-5
    eps: float = 1e-5
    anneal_lr: bool = True
    max_grad_norm: Optional[float] = None

    kl_controller: str = "adaptive"
    init_kl_coef: float = 0.15
    kl_target: float = 6.0
    kl_horizon: int = 10000

    critic_init: str = "reward"
    shared_trunk: bool = False
    recompute_rollout_logprobs: bool = True

    seed: int = 1
    pad_token_id: int = 50259

    def __post_init__(self):
        if self.batch_size % self.nminibatches:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by "
                             f"nminibatches={self.nminibatches}")
        if self.minibatch_size % self.gradient_accumulation_steps:
            raise ValueError(f"minibatch size {self.minibatch_size} is not divisible by "
                             f"gradient_accumulation_steps={self.gradient_accumulation_steps}")
        if self.total_episodes < self.batch_size:
            raise ValueError(f"total_episodes={self.total_episodes} < batch_size="
                             f"{self.batch_size}: the run would do no update")
        for name, allowed in (("optimizer", ("tf_adam", "adam")),
                              ("kl_controller", ("adaptive", "fixed")),
                              ("critic_init", ("reward", "policy"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {allowed}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.nminibatches

    @property
    def microbatch_size(self) -> int:
        return self.minibatch_size // self.gradient_accumulation_steps

    @property
    def num_updates(self) -> int:
        return self.total_episodes // self.batch_size

    def replace(self, **changes) -> "PPOConfig":
        return dataclasses.replace(self, **changes)
