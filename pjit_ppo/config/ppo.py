"""The PPO stage's config: the `ppo` section (`PPOConfig`) and the whole run
(`PPORunConfig`: ppo + the shared sections + run-level switches).

Run length has one source: `PPORunConfig.num_updates` (= `num_iterations` when > 0,
else `ppo.total_episodes // ppo.batch_size`); the loop length, the LR anneal and the
console ETA all use it.
"""
import dataclasses
from typing import Any, Dict, Optional, Tuple

from pjit_ppo.config.checks import (check_types_and_finiteness, choice, finite_number,
                                    int_at_least, need, non_negative, number_in, positive)
from pjit_ppo.config.sections import (OPTIMIZERS, CheckpointOptions, DataOptions, EvalOptions,
                                      MeshConfig, ModelOptions, ProfileOptions, RewardOptions,
                                      SequenceOptions)
from pjit_ppo.config.estimators import ESTIMATORS
from pjit_ppo.rewards import registry as reward_kinds

#: Allowed values of the PPO section's enum-like fields.
KL_CONTROLLERS = ("adaptive", "fixed")
CRITIC_INITS = ("reward", "policy")
#: The estimators (one table: pjit_ppo/config/estimators.py), those without a critic,
#: and those whose advantages need at least two samples of each prompt.
ADVANTAGE_ESTIMATORS = tuple(ESTIMATORS)
CRITIC_FREE_ESTIMATORS = tuple(n for n, e in ESTIMATORS.items() if not e.uses_critic)
GROUP_ESTIMATORS = tuple(n for n, e in ESTIMATORS.items() if e.min_samples_per_prompt >= 2)
LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "sequence_sum")
IMPORTANCE_RATIOS = ("token", "sequence")


@dataclasses.dataclass(slots=True)
class PPOConfig(SequenceOptions):
    """Policy learning. Defaults follow lm-human-preferences' sentiment recipe except
    where noted (`docs/semantics.md` lists the semantics and the differences). The
    sequence and sampling fields (query_length, response_length, pad_token_id,
    temperature, top_k, top_p, top_p_mode, truncate_token, truncate_after) are
    `SequenceOptions`', shared with reward learning.

    The library's functions close over this object when they compile; change it
    before building a trainer, not after.
    """

    # Sizes.
    batch_size: int = 512                # episodes per PPO iteration, global over all devices
    samples_per_prompt: int = 1          # G: responses per prompt. The prompt pipeline delivers
    #                                      batch_size // G prompts; the rollout repeats each G
    #                                      times, so a group is G contiguous rows
    nminibatches: int = 1                # optimizer steps per epoch
    noptepochs: int = 4                  # passes over the batch per iteration, fresh shuffle each
    gradient_accumulation_steps: int = 1  # micro-batches per minibatch (a memory knob only)
    rollout_micro_batch_size: int = 0    # episodes per sampling + scoring pass of the rollout
    #                                      (a memory knob only: the KV cache and activations
    #                                      scale with it; the same samples as the whole batch,
    #                                      log-probs and values equal to float rounding).
    #                                      0 = the whole batch in one pass; else a divisor of
    #                                      batch_size that the batch devices divide
    total_episodes: int = 1_000_000      # run length when num_iterations <= 0

    # Post-processing of responses before the reward sees them.
    penalty_reward_value: float = -1.0   # score of a response without a stop token

    # Losses.
    cliprange: float = 0.2               # policy ratio clipped to [1 - c, 1 + c]
    cliprange_value: float = 0.2         # value prediction clipped to old +- c
    vf_coef: float = 0.1                 # value loss weight (see docs: barely matters with a
    #                                      separate critic and per-parameter Adam)
    gamma: float = 1.0                   # discount
    lam: float = 0.95                    # GAE lambda
    whiten_rewards: bool = True          # rewards scaled to unit variance (mean kept)
    advantage_estimator: str = "gae"     # estimator + loss pair (pjit_ppo.ppo.estimators):
    #                                      "gae" (PPO with a critic), or critic-free "grpo",
    #                                      "rloo", "reinforce_pp"
    loss_aggregation: str = "token_mean"  # how token losses become one number: "token_mean"
    #                                      (over the micro-batch's tokens), "sequence_mean"
    #                                      (per sequence, then over sequences), "sequence_sum"
    #                                      (per-sequence sum / response_length, Dr. GRPO)
    cliprange_low: Optional[float] = None   # ratio clipped to [1 - low, 1 + high]; None =
    cliprange_high: Optional[float] = None  # cliprange (DAPO's clip-higher: high > low)
    importance_ratio: str = "token"      # "token" (PPO) or "sequence" (GSPO: geometric mean
    #                                      of the token ratios, clipped per sequence)
    grpo_normalize_std: bool = True      # grpo: divide by the group std (False = Dr. GRPO)
    kl_loss_coef: float = 0.04           # grpo: weight of the k3 KL-to-reference loss term

    # Optimisation.
    optimizer: str = "tf_adam"           # "tf_adam" (eps on the uncorrected moment) or "adam"
    lr: float = 1e-5
    eps: float = 1e-5                    # Adam epsilon
    anneal_lr: bool = True               # linear to 0 over the run's updates, constant within one
    max_grad_norm: Optional[float] = None  # global-norm gradient clipping; None = off

    # KL penalty.
    kl_controller: str = "adaptive"      # "adaptive" (Ziegler et al. 2019) or "fixed"
    init_kl_coef: float = 0.15
    kl_target: float = 6.0               # nats per episode (adaptive only)
    kl_horizon: int = 10000              # episodes (adaptive only)

    # Models. Unlike lm-human-preferences (value head on the policy trunk), the critic
    # is a separate model by default, initialised from the reward model's trunk.
    critic_init: str = "reward"          # "reward" or "policy": where the critic's trunk comes from
    shared_trunk: bool = False           # value head on the policy trunk (no separate critic)
    critic_lora: bool = True             # with model.lora.rank > 0: the critic trains LoRA
    #                                      adapters (model.lora's rank, alpha, targets) on its
    #                                      frozen trunk (the reward model's or the policy's,
    #                                      shared with that frozen model: no copy) and a full
    #                                      value head; False: the whole critic trains (fp32
    #                                      weights + Adam moments, 16 bytes per parameter).
    #                                      No effect without LoRA or without a critic
    recompute_rollout_logprobs: bool = True  # recompute old logprobs with a full forward
    #                                          (exact reference semantics) instead of the sampler's

    seed: int = 1                        # base seed of every random stream of the run

    def __post_init__(self):
        self.validate()

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.nminibatches

    @property
    def microbatch_size(self) -> int:
        return self.minibatch_size // self.gradient_accumulation_steps

    @property
    def prompts_per_iteration(self) -> int:
        """Prompts the pipeline delivers per iteration: batch_size // samples_per_prompt."""
        return self.batch_size // self.samples_per_prompt

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator trains a critic (False for the critic-free ones)."""
        return self.advantage_estimator not in CRITIC_FREE_ESTIMATORS

    @property
    def clip_bounds(self) -> Tuple[float, float]:
        """(low, high): the policy ratio is clipped to [1 - low, 1 + high]."""
        low = self.cliprange if self.cliprange_low is None else self.cliprange_low
        high = self.cliprange if self.cliprange_high is None else self.cliprange_high
        return low, high

    def validate(self) -> "PPOConfig":
        """Checks every field; raises ConfigError naming the field and the fix."""
        self.validate_sequences("ppo.")
        for name in ("batch_size", "samples_per_prompt", "nminibatches", "noptepochs",
                     "gradient_accumulation_steps", "total_episodes", "kl_horizon"):
            int_at_least(f"ppo.{name}", getattr(self, name), 1)
        finite_number("ppo.penalty_reward_value", self.penalty_reward_value)
        positive("ppo.cliprange", self.cliprange, ": the policy ratio is clipped to "
                 "[1 - cliprange, 1 + cliprange]")
        positive("ppo.cliprange_value", self.cliprange_value, ": the value prediction is "
                 "clipped to the old value +- cliprange_value")
        non_negative("ppo.vf_coef", self.vf_coef)
        non_negative("ppo.init_kl_coef", self.init_kl_coef, ": it is the weight of a penalty")
        positive("ppo.kl_target", self.kl_target, " (nats per episode)")
        non_negative("ppo.kl_loss_coef", self.kl_loss_coef)
        int_at_least("ppo.seed", self.seed, 0)
        need(self.batch_size % self.nminibatches == 0,
              f"ppo.batch_size={self.batch_size} is not divisible by ppo.nminibatches="
              f"{self.nminibatches}; pick a batch size that is a multiple of it")
        need(self.minibatch_size % self.gradient_accumulation_steps == 0,
              f"minibatch size {self.minibatch_size} (ppo.batch_size / ppo.nminibatches) is not "
              f"divisible by ppo.gradient_accumulation_steps={self.gradient_accumulation_steps}")
        need(isinstance(self.rollout_micro_batch_size, int)
              and self.rollout_micro_batch_size >= 0
              and (self.rollout_micro_batch_size == 0
                   or self.batch_size % self.rollout_micro_batch_size == 0),
              f"ppo.rollout_micro_batch_size={self.rollout_micro_batch_size!r} must be 0 (the "
              f"whole batch) or a divisor of ppo.batch_size={self.batch_size}")
        need(self.total_episodes >= self.batch_size,
              f"ppo.total_episodes={self.total_episodes} < ppo.batch_size={self.batch_size}: the "
              f"run would do no update")
        choice("ppo.optimizer", self.optimizer, OPTIMIZERS)
        choice("ppo.kl_controller", self.kl_controller, KL_CONTROLLERS)
        choice("ppo.critic_init", self.critic_init, CRITIC_INITS)
        choice("ppo.advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        choice("ppo.loss_aggregation", self.loss_aggregation, LOSS_AGGREGATIONS)
        choice("ppo.importance_ratio", self.importance_ratio, IMPORTANCE_RATIOS)
        self._validate_estimator()
        for name in ("gamma", "lam"):
            number_in(f"ppo.{name}", getattr(self, name), 0.0, 1.0)
        non_negative("ppo.lr", self.lr)
        positive("ppo.eps", self.eps)
        if self.max_grad_norm is not None:
            positive("ppo.max_grad_norm", self.max_grad_norm, " (or None to disable clipping)")
        return self

    def _validate_estimator(self) -> None:
        """Samples per prompt, the critic-free estimators and the policy-loss options."""
        g, name = self.samples_per_prompt, self.advantage_estimator
        need(self.batch_size % g == 0,
              f"ppo.batch_size={self.batch_size} is not divisible by ppo.samples_per_prompt={g}: "
              f"batch_size counts episodes (prompts x samples), so pick a multiple of "
              f"samples_per_prompt")
        least = ESTIMATORS[name].min_samples_per_prompt
        if least > 1:
            need(g >= least, f"ppo.advantage_estimator={name!r} compares the samples of a "
                             f"prompt and needs ppo.samples_per_prompt >= {least} (got {g})")
        if name in CRITIC_FREE_ESTIMATORS:
            need(not self.shared_trunk,
                  f"ppo.shared_trunk=True puts a value head on the policy, but "
                  f"ppo.advantage_estimator={name!r} trains no critic: set shared_trunk=False")
        for field in ("cliprange_low", "cliprange_high"):
            value = getattr(self, field)
            if value is not None:
                finite_number(f"ppo.{field}", value)
                need(value >= 0, f"ppo.{field}={value} must be >= 0 (or None = ppo.cliprange)")


@dataclasses.dataclass(slots=True)
class PPORunConfig:
    """A whole PPO run (`pjit-ppo-train`): the PPO section, the shared sections and
    run-level switches. (`RunConfig` is the same class under its earlier name.)"""

    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    reward: RewardOptions = dataclasses.field(default_factory=RewardOptions)
    data: DataOptions = dataclasses.field(default_factory=DataOptions)
    checkpoint: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    evaluation: EvalOptions = dataclasses.field(default_factory=EvalOptions)
    profile: ProfileOptions = dataclasses.field(default_factory=ProfileOptions)
    num_iterations: int = -1          # PPO iterations; <= 0: ppo.total_episodes // ppo.batch_size
    tensorboard: bool = True          # also write TensorBoard event files
    measure_peak: bool = True         # measure a matmul peak at start-up for MFU metrics

    @property
    def num_updates(self) -> int:
        """The run length in PPO iterations (the one source for loop, LR anneal and ETA)."""
        if self.num_iterations > 0:
            return self.num_iterations
        return self.ppo.total_episodes // self.ppo.batch_size

    def validate(self) -> "PPORunConfig":
        """Checks every section and how they relate; raises ConfigError."""
        check_types_and_finiteness(self)
        self.ppo.validate()
        self.mesh.validate()
        self.model.validate()
        self.reward.validate()
        self.data.validate()
        self.checkpoint.validate()
        self.evaluation.validate()
        self.profile.validate()
        need(isinstance(self.num_iterations, int), f"num_iterations={self.num_iterations!r} "
                                                    f"must be an integer")
        need(self.data.min_prompt_length <= self.ppo.query_length,
              f"data.min_prompt_length={self.data.min_prompt_length} exceeds ppo.query_length="
              f"{self.ppo.query_length}")
        if self.ppo.uses_critic and not self.ppo.shared_trunk and self.ppo.critic_init == "reward":
            kinds = reward_kinds.critic_trunk_kinds()
            need(self.reward.kind in kinds,
                  f"ppo.critic_init='reward' needs "
                  f"{' or '.join(f'reward.kind={k!r}' for k in kinds)} (got "
                  f"{self.reward.kind!r}); use ppo.critic_init='policy' with a synthetic reward")
        return self

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready nested dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, tree: Dict[str, Any]) -> "PPORunConfig":
        """The config a `to_dict()` (e.g. read back from a checkpoint's JSON) describes.

        Unknown fields raise ConfigError; missing ones take their defaults.
        """
        sections = {f.name: f.default_factory for f in dataclasses.fields(cls)
                    if f.default_factory is not dataclasses.MISSING}
        kwargs = {}
        for name, value in tree.items():
            if name in sections:
                section = sections[name]
                known = {f.name: f for f in dataclasses.fields(section)}
                unknown = sorted(set(value) - set(known))
                need(not unknown, "unknown config field(s) "
                                   + ", ".join(f"{name}.{u}" for u in unknown))
                value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
                kwargs[name] = section(**value)
            else:
                need(name in {f.name for f in dataclasses.fields(cls)},
                      f"unknown config field {name!r}")
                kwargs[name] = value
        return cls(**kwargs)



#: The earlier name of PPORunConfig, kept for recipes and code that use it.
RunConfig = PPORunConfig
