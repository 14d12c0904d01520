"""The one typed run config: every section, its defaults, its documentation, its checks.

A recipe file (`configs/*.py`) defines `get_config(arg="") -> RunConfig`;
`ml_collections.config_flags.DEFINE_config_file` reads it and applies dotted
overrides (`--config.ppo.lr=1e-6`) to these dataclasses. Each field is documented
where it is defined, below. The classes use `__slots__`, so assigning a field that
does not exist (a typo in a recipe or an override) fails instead of being ignored.

Validation lives here and only here: `RunConfig.validate()` checks every section
(and how sections relate, e.g. a critic initialised from a reward model needs one)
and raises `ConfigError` naming the field, its value and the fix. Library code
that receives a section (`PPOConfig`, `SamplingOptions`) validates it through the
same methods.

Run length has one source: `RunConfig.num_updates` (= `num_iterations` when > 0,
else `ppo.total_episodes // ppo.batch_size`); the loop length, the LR anneal and
the console ETA all use it.
"""
import dataclasses
import json
import math
import typing
from typing import Any, Dict, Optional, Tuple

from pjit_ppo.errors import ConfigError

#: Allowed values of the enum-like fields, in one place.
OPTIMIZERS = ("tf_adam", "adam")
KL_CONTROLLERS = ("adaptive", "fixed")
CRITIC_INITS = ("reward", "policy")
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp")
#: Estimators without a critic (pjit_ppo.ppo.estimators.ESTIMATORS[...].uses_critic False)
#: and those whose advantages need at least two samples of each prompt.
CRITIC_FREE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
GROUP_ESTIMATORS = ("grpo", "rloo")
LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "sequence_sum")
IMPORTANCE_RATIOS = ("token", "sequence")
TOP_P_MODES = ("transformers", "lm_human_preferences")
REWARD_KINDS = ("model", "target_tokens")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")




def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(field: str, value: Any, allowed: Tuple[str, ...]) -> None:
    _need(value in allowed, f"{field}={value!r}; choose one of {', '.join(map(repr, allowed))}")


def _finite_number(field: str, value: Any) -> None:
    _need(isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value), f"{field}={value!r} must be a finite number")


def _type_name(hint: Any) -> str:
    """How a field's annotation reads in an error message ("int", "float or None", ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        return f"a tuple of {_type_name(args[0])}" if args else "a tuple"
    if origin is dict:
        return "a dict"
    return getattr(hint, "__name__", str(hint))


def _has_type(value: Any, hint: Any) -> bool:
    """Whether `value` fits a field annotation (an int is a float; a bool is not an int)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is typing.Union:
        return any(_has_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is tuple:
        return isinstance(value, (tuple, list)) and all(
            _has_type(v, args[0]) for v in value) if args else isinstance(value, tuple)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is typing.Literal:
        return value in args
    if origin is not None:  # list[...], Sequence[...], ...: the container type only
        return isinstance(value, origin)
    return isinstance(value, hint) if isinstance(hint, type) else True


def check_field_types(section: Any, prefix: str) -> None:
    """Every field of a config dataclass has its annotated type; raises ConfigError."""
    for name, hint in typing.get_type_hints(type(section)).items():
        value = getattr(section, name)
        _need(_has_type(value, hint), f"{prefix}{name}={value!r} has type {type(value).__name__}; "
                                      f"it must be {_type_name(hint)}")


def check_finite(tree: Any, prefix: str = "") -> None:
    """No NaN or infinity anywhere in a nested dict / list of config values (e.g.
    `RunConfig.to_dict()`, including model.random); raises ConfigError naming the field."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            check_finite(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            check_finite(value, f"{prefix}[{i}]")
    elif isinstance(tree, float):
        _need(math.isfinite(tree), f"{prefix}={tree!r}: NaN and infinity are not valid config "
                                   f"values; give a finite number")


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """Static options of the KV-cache sampler (Python values, compiled into the program).

    Attributes:
      max_new_tokens: tokens generated per row (always exactly this many).
      temperature: logits are divided by it, for sampling and for the returned
        log-probs. Must be > 0 (it does not change which token `greedy` picks).
      top_k: keep only the k most likely tokens when sampling (0 = off).
      top_p: nucleus sampling threshold in (0, 1] (1.0 = off), applied after top_k.
      top_p_mode: which tokens the nucleus keeps. "transformers": the smallest set
        of most likely tokens whose mass reaches top_p (the token that crosses top_p
        is kept). "lm_human_preferences": only the tokens whose running total,
        itself included, is <= top_p (and at least the most likely token).
      greedy: pick the argmax instead of sampling (top_k / top_p are ignored).
      stop_token: once a row emits this id at index >= min_new_tokens, its later
        tokens become pad_token_id with log-prob 0. None = never stop.
      min_new_tokens: stop tokens before this index do not stop a row (None = 0).
      pad_token_id: id written after a stop token; required with stop_token.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    top_p_mode: str = "transformers"
    greedy: bool = False
    stop_token: Optional[int] = None
    min_new_tokens: Optional[int] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        for name in ("max_new_tokens", "top_k"):
            value = getattr(self, name)
            _need(isinstance(value, int) and not isinstance(value, bool),
                  f"{name} must be a Python int (static), got {value!r}")
        _need(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _need(self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            _need(isinstance(value, (int, float)) and not isinstance(value, bool),
                  f"{name} must be a Python float (static), got {type(value).__name__}; "
                  f"sampling options are compiled into the function")
        _need(self.temperature > 0, f"temperature must be > 0 (it also scales the returned "
                                    f"logprobs), got {self.temperature}")
        _need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1] (1.0 = off), got {self.top_p}")
        _choice("top_p_mode", self.top_p_mode, TOP_P_MODES)
        if self.stop_token is not None:
            _need(self.pad_token_id is not None,
                  "stop_token is set but pad_token_id is None: pass pad_token_id, the id "
                  "written after a row's stop token")
        if self.min_new_tokens is not None:
            _need(isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0,
                  f"min_new_tokens must be a Python int >= 0, got {self.min_new_tokens!r}")


@dataclasses.dataclass(slots=True)
class PPOConfig:
    """Policy learning. Defaults follow lm-human-preferences' sentiment recipe except
    where noted (`docs/semantics.md` lists the semantics and the differences).

    The library's functions close over this object when they compile; change it
    before building a trainer, not after.
    """

    # Sizes.
    query_length: int = 64               # prompt tokens (left-padded / truncated to this)
    response_length: int = 24            # sampled tokens per episode (always exactly this many)
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

    # Sampling (the temperature also divides the logits of every log-prob in training).
    temperature: float = 0.7
    top_k: int = 0                       # 0 = off
    top_p: float = 1.0                   # 1.0 = off
    top_p_mode: str = "transformers"     # see SamplingOptions.top_p_mode

    # Post-processing of responses before the reward sees them.
    truncate_token: Optional[int] = 13   # stop token id (GPT-2 '.'); None disables truncation
    truncate_after: int = 16             # only stop tokens at index >= this count
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
    recompute_rollout_logprobs: bool = True  # recompute old logprobs with a full forward
    #                                          (exact reference semantics) instead of the sampler's

    seed: int = 1                        # base seed of every random stream of the run
    pad_token_id: int = 50259            # pad id of prompts and truncated responses

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

    def sampling_options(self) -> SamplingOptions:
        """The sampler's options for a rollout: response_length tokens, no early stop."""
        return SamplingOptions(max_new_tokens=self.response_length, temperature=self.temperature,
                               top_k=self.top_k, top_p=self.top_p, top_p_mode=self.top_p_mode)

    def validate(self) -> "PPOConfig":
        """Checks every field; raises ConfigError naming the field and the fix."""
        for name in ("query_length", "response_length", "batch_size", "samples_per_prompt",
                     "nminibatches", "noptepochs", "gradient_accumulation_steps",
                     "total_episodes", "kl_horizon"):
            value = getattr(self, name)
            _need(isinstance(value, int) and value >= 1, f"ppo.{name}={value!r} must be an "
                                                         f"integer >= 1")
        for name in ("temperature", "top_p", "cliprange", "cliprange_value", "vf_coef", "gamma",
                     "lam", "lr", "eps", "init_kl_coef", "kl_target", "penalty_reward_value",
                     "kl_loss_coef"):
            _finite_number(f"ppo.{name}", getattr(self, name))
        _need(self.batch_size % self.nminibatches == 0,
              f"ppo.batch_size={self.batch_size} is not divisible by ppo.nminibatches="
              f"{self.nminibatches}; pick a batch size that is a multiple of it")
        _need(self.minibatch_size % self.gradient_accumulation_steps == 0,
              f"minibatch size {self.minibatch_size} (ppo.batch_size / ppo.nminibatches) is not "
              f"divisible by ppo.gradient_accumulation_steps={self.gradient_accumulation_steps}")
        _need(isinstance(self.rollout_micro_batch_size, int)
              and self.rollout_micro_batch_size >= 0
              and (self.rollout_micro_batch_size == 0
                   or self.batch_size % self.rollout_micro_batch_size == 0),
              f"ppo.rollout_micro_batch_size={self.rollout_micro_batch_size!r} must be 0 (the "
              f"whole batch) or a divisor of ppo.batch_size={self.batch_size}")
        _need(self.total_episodes >= self.batch_size,
              f"ppo.total_episodes={self.total_episodes} < ppo.batch_size={self.batch_size}: the "
              f"run would do no update")
        _choice("ppo.optimizer", self.optimizer, OPTIMIZERS)
        _choice("ppo.kl_controller", self.kl_controller, KL_CONTROLLERS)
        _choice("ppo.critic_init", self.critic_init, CRITIC_INITS)
        _choice("ppo.advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        _choice("ppo.loss_aggregation", self.loss_aggregation, LOSS_AGGREGATIONS)
        _choice("ppo.importance_ratio", self.importance_ratio, IMPORTANCE_RATIOS)
        self._validate_estimator()
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            _need(0.0 <= value <= 1.0, f"ppo.{name}={value} must be in [0, 1]")
        _need(self.lr >= 0, f"ppo.lr={self.lr} must be >= 0")
        _need(self.eps > 0, f"ppo.eps={self.eps} must be > 0")
        if self.max_grad_norm is not None:
            _finite_number("ppo.max_grad_norm", self.max_grad_norm)
            _need(self.max_grad_norm > 0, f"ppo.max_grad_norm={self.max_grad_norm} must be > 0 "
                                          f"(or None to disable clipping)")
        try:
            self.sampling_options()
        except ConfigError as e:
            raise ConfigError(f"ppo.{e}") from None
        return self

    def _validate_estimator(self) -> None:
        """Samples per prompt, the critic-free estimators and the policy-loss options."""
        g, name = self.samples_per_prompt, self.advantage_estimator
        _need(self.batch_size % g == 0,
              f"ppo.batch_size={self.batch_size} is not divisible by ppo.samples_per_prompt={g}: "
              f"batch_size counts episodes (prompts x samples), so pick a multiple of "
              f"samples_per_prompt")
        if name in GROUP_ESTIMATORS:
            _need(g >= 2, f"ppo.advantage_estimator={name!r} compares the samples of a prompt "
                          f"and needs ppo.samples_per_prompt >= 2 (got {g})")
        if name in CRITIC_FREE_ESTIMATORS:
            _need(not self.shared_trunk,
                  f"ppo.shared_trunk=True puts a value head on the policy, but "
                  f"ppo.advantage_estimator={name!r} trains no critic: set shared_trunk=False")
        for field in ("cliprange_low", "cliprange_high"):
            value = getattr(self, field)
            if value is not None:
                _finite_number(f"ppo.{field}", value)
                _need(value >= 0, f"ppo.{field}={value} must be >= 0 (or None = ppo.cliprange)")
        _need(self.kl_loss_coef >= 0, f"ppo.kl_loss_coef={self.kl_loss_coef} must be >= 0")


@dataclasses.dataclass(slots=True)
class MeshConfig:
    """Device mesh sizes; one of them may be -1 (= all remaining devices)."""

    data: int = 1      # pure data parallelism (parameters replicated)
    fsdp: int = -1     # batch and parameters sharded (ZeRO-3 style)
    tensor: int = 1    # heads / mlp / vocab sharded within a layer

    def validate(self) -> "MeshConfig":
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, value in sizes.items():
            _need(isinstance(value, int) and (value >= 1 or value == -1),
                  f"mesh.{name}={value!r} must be a positive integer or -1")
        _need(list(sizes.values()).count(-1) <= 1,
              f"at most one mesh axis may be -1, got {sizes}")
        return self


@dataclasses.dataclass(slots=True)
class ModelOptions:
    """Where the policy comes from and how every model computes."""

    policy_path: str = ""             # HF model directory; "" = random init from `random`
    compute_dtype: str = "float32"    # activations and matmuls; "bfloat16" on accelerators
    remat_policy: str = "none"        # "none", "full", or a jax.checkpoint_policies name
    scan_unroll: int = 1              # layers per scan step (n_layers = fully unrolled)
    random: Dict[str, Any] = dataclasses.field(default_factory=dict)  # HF config.json dict
    #                                   of a randomly initialised model (demos, tests, planning)

    def validate(self) -> "ModelOptions":
        _choice("model.compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        _need(isinstance(self.scan_unroll, int) and self.scan_unroll >= 1,
              f"model.scan_unroll={self.scan_unroll!r} must be an integer >= 1")
        _need(bool(self.policy_path) or bool(self.random),
              "model.policy_path is empty and model.random is empty: point model.policy_path "
              "at an HF model directory or give model.random an HF config dict")
        return self

    def overrides(self) -> Dict[str, Any]:
        """The ModelConfig fields this section sets on every model it loads."""
        return dict(compute_dtype=self.compute_dtype, remat_policy=self.remat_policy,
                    scan_unroll=self.scan_unroll)


@dataclasses.dataclass(slots=True)
class RewardOptions:
    """The reward the policy is trained against."""

    kind: str = "target_tokens"       # "model" (a reward model) or "target_tokens" (demo)
    path: str = ""                    # HF directory of the reward trunk ("" = model.random)
    head_seed: int = 0                # reward head init N(0, 1/sqrt(d + 1)) until trained
    target_ids: Tuple[int, ...] = (5, 6, 7)  # kind="target_tokens": the rewarded token ids

    def validate(self) -> "RewardOptions":
        _choice("reward.kind", self.kind, REWARD_KINDS)
        if self.kind == "target_tokens":
            _need(len(self.target_ids) > 0, "reward.target_ids is empty: list the token ids "
                                            "the target_tokens reward counts")
        return self


@dataclasses.dataclass(slots=True)
class DataOptions:
    """Prompts: text from a local file tokenised with an HF tokenizer (pjit_ppo.data.prompts),
    or, with no prompts_path, random token prompts generated on the devices (tests, smoke)."""

    prompts_path: str = ""            # JSONL, plain text (one prompt per line) or a directory
    #                                   saved by HF datasets; "" = random token prompts
    prompts_format: str = "auto"      # "auto" (from the path), "jsonl", "text", "hf_dataset"
    prompt_field: str = "prompt"      # JSONL key / datasets column holding the prompt text
    eval_prompts_path: str = ""       # held-out prompts for evaluation ("" = prompts_path,
    #                                   in an order of its own); same format and field
    tokenizer_path: str = ""          # HF tokenizer directory; "" = model.policy_path
    start_text: str = ""              # if set, a prompt starts after its first occurrence
    end_text: str = ""                # if set, a prompt ends after its last occurrence
    shuffle: bool = True              # a fresh permutation of the prompt set each epoch
    samples_every: int = 10           # iterations between decoded sample tables (0 = off)
    samples_per_table: int = 8        # rows per table in WORKDIR/samples.jsonl
    min_prompt_length: int = 1        # random prompts: lengths uniform in [this, query_length]
    low_token: int = 0                # random prompts: tokens uniform in [low_token, vocab_size)

    def validate(self) -> "DataOptions":
        _choice("data.prompts_format", self.prompts_format,
                ("auto", "jsonl", "text", "hf_dataset"))
        _need(bool(self.prompt_field), "data.prompt_field is empty: name the JSONL key or "
                                       "dataset column that holds the prompt")
        _need(isinstance(self.samples_every, int) and self.samples_every >= 0,
              f"data.samples_every={self.samples_every!r} must be an integer >= 0 (0 = off)")
        _need(isinstance(self.samples_per_table, int) and self.samples_per_table >= 1,
              f"data.samples_per_table={self.samples_per_table!r} must be an integer >= 1")
        _need(self.min_prompt_length >= 1,
              f"data.min_prompt_length={self.min_prompt_length} must be >= 1")
        _need(self.low_token >= 0, f"data.low_token={self.low_token} must be >= 0")
        return self


@dataclasses.dataclass(slots=True)
class CheckpointOptions:
    """Orbax checkpoints of the train state in WORKDIR/checkpoints/<iteration>/."""

    every: int = 10                   # iterations between saves (there is always one at the end)
    keep: int = 3                     # keep the last K checkpoints
    keep_period: int = 0              # also keep every checkpoint whose iteration is a multiple
    #                                   of this (0 = off)
    async_save: bool = True           # write in the background while training goes on
    resume: bool = True               # continue from the latest complete checkpoint in WORKDIR

    def validate(self) -> "CheckpointOptions":
        _need(isinstance(self.every, int) and self.every >= 1,
              f"checkpoint.every={self.every!r} must be an integer >= 1")
        _need(isinstance(self.keep, int) and self.keep >= 1,
              f"checkpoint.keep={self.keep!r} must be an integer >= 1")
        _need(isinstance(self.keep_period, int) and self.keep_period >= 0,
              f"checkpoint.keep_period={self.keep_period!r} must be an integer >= 0 (0 = off)")
        return self


@dataclasses.dataclass(slots=True)
class EvalOptions:
    """Evaluation of a checkpoint (launch/evaluate.py): held-out prompts, both policies."""

    num_prompts: int = 256            # evaluation prompts (from their own random stream)
    temperature: float = 0.0          # sampling temperature; 0 = ppo.temperature
    greedy: bool = False              # argmax decoding instead of sampling
    seed: int = 0                     # seed of the evaluation prompts and samples

    def validate(self) -> "EvalOptions":
        _need(isinstance(self.num_prompts, int) and self.num_prompts >= 1,
              f"evaluation.num_prompts={self.num_prompts!r} must be an integer >= 1")
        _finite_number("evaluation.temperature", self.temperature)
        _need(self.temperature >= 0, f"evaluation.temperature={self.temperature} must be > 0, "
                                     f"or 0 for ppo.temperature")
        return self


@dataclasses.dataclass(slots=True)
class ProfileOptions:
    """A jax.profiler trace of chosen iterations into WORKDIR/profile/ (TensorBoard's
    profile plugin or Perfetto open it)."""

    start: int = 0                    # first traced iteration, numbered as in metrics.jsonl
    #                                   (1 = the first; its compile is not traced); 0 = off
    iterations: int = 1               # how many iterations the trace covers

    def validate(self) -> "ProfileOptions":
        _need(isinstance(self.start, int) and self.start >= 0,
              f"profile.start={self.start!r} must be an integer >= 0 (0 = no trace)")
        _need(isinstance(self.iterations, int) and self.iterations >= 1,
              f"profile.iterations={self.iterations!r} must be an integer >= 1")
        return self


@dataclasses.dataclass(slots=True)
class RunConfig:
    """A whole PPO run: the sections above plus run-level switches."""

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

    def validate(self) -> "RunConfig":
        """Checks every section and how they relate; raises ConfigError."""
        check_field_types(self, "")
        for field in dataclasses.fields(self):
            section = getattr(self, field.name)
            if dataclasses.is_dataclass(section):
                check_field_types(section, f"{field.name}.")
        check_finite(self.to_dict())
        self.ppo.validate()
        self.mesh.validate()
        self.model.validate()
        self.reward.validate()
        self.data.validate()
        self.checkpoint.validate()
        self.evaluation.validate()
        self.profile.validate()
        _need(isinstance(self.num_iterations, int), f"num_iterations={self.num_iterations!r} "
                                                    f"must be an integer")
        _need(self.data.min_prompt_length <= self.ppo.query_length,
              f"data.min_prompt_length={self.data.min_prompt_length} exceeds ppo.query_length="
              f"{self.ppo.query_length}")
        if self.ppo.uses_critic and not self.ppo.shared_trunk and self.ppo.critic_init == "reward":
            _need(self.reward.kind == "model",
                  f"ppo.critic_init='reward' needs reward.kind='model' (got "
                  f"{self.reward.kind!r}); use ppo.critic_init='policy' with a synthetic reward")
        return self

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready nested dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, tree: Dict[str, Any]) -> "RunConfig":
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
                _need(not unknown, "unknown config field(s) "
                                   + ", ".join(f"{name}.{u}" for u in unknown))
                value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
                kwargs[name] = section(**value)
            else:
                _need(name in {f.name for f in dataclasses.fields(cls)},
                      f"unknown config field {name!r}")
                kwargs[name] = value
        return cls(**kwargs)


#: Fields a resumed run may change: how it is laid out, how long it runs, what it logs.
#: Every other field must equal the checkpoint's (prefix match on the dotted name).
RESUMABLE_CHANGES = ("mesh.", "num_iterations", "tensorboard", "measure_peak", "checkpoint.",
                     "evaluation.", "profile.")


def _flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(tree, dict):
        out: Dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def resume_conflicts(saved: Dict[str, Any], current: Dict[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """Fields whose value differs between a checkpoint's config and the current one.

    Both are `RunConfig.to_dict()` results (the saved one read back from JSON).
    Returns {dotted field: (saved value, current value)} for every field that is not
    in RESUMABLE_CHANGES; empty when the run may resume.
    """
    current = json_round_trip(current)
    a, b = _flatten(saved), _flatten(current)
    # A field the checkpoint lacks was added to the library after it was written; at
    # its default value it computes what the older version did.
    defaults = _flatten(json_round_trip(RunConfig().to_dict()))
    out = {}
    for name in sorted(set(a) | set(b)):
        if name.startswith(RESUMABLE_CHANGES):
            continue
        if name not in a and name in defaults and b.get(name) == defaults[name]:
            continue
        if a.get(name, "<absent>") != b.get(name, "<absent>"):
            out[name] = (a.get(name, "<absent>"), b.get(name, "<absent>"))
    return out


def json_round_trip(tree: Any) -> Any:
    """`tree` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(tree, default=str))


# The configs of the stages before PPO share these sections (defined in stages.py).
from pjit_ppo.config.stages import RewardLearningConfig, SFTConfig  # noqa: E402
