"""The config sections every stage shares: the device mesh, the model, the sampler and
the query/response sequences, the reward, the prompts, checkpoints, evaluation and
profiling. Each field is documented where it is defined; `validate()` raises ConfigError
naming the field, its value and the fix."""
import dataclasses
import re
from typing import Any, Dict, Optional, Tuple

from pjit_ppo.config.checks import (check_field_types, choice, finite_number, int_at_least,
                                    need, number_in, positive)
from pjit_ppo.errors import ConfigError
from pjit_ppo.rewards import registry as reward_kinds

#: Allowed values of the enum-like fields shared by several stages.
OPTIMIZERS = ("tf_adam", "adam")
TOP_P_MODES = ("transformers", "lm_human_preferences")
REWARD_KINDS = tuple(reward_kinds.KINDS)  # one module each in pjit_ppo/rewards/
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
PROMPT_FORMATS = ("auto", "jsonl", "text", "hf_dataset")


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
            need(isinstance(value, int) and not isinstance(value, bool),
                  f"{name} must be a Python int (static), got {value!r}")
        need(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        need(self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool),
                  f"{name} must be a Python float (static), got {type(value).__name__}; "
                  f"sampling options are compiled into the function")
        need(self.temperature > 0, f"temperature must be > 0 (it also scales the returned "
                                    f"logprobs), got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1] (1.0 = off), got {self.top_p}")
        choice("top_p_mode", self.top_p_mode, TOP_P_MODES)
        if self.stop_token is not None:
            need(self.pad_token_id is not None,
                  "stop_token is set but pad_token_id is None: pass pad_token_id, the id "
                  "written after a row's stop token")
        if self.min_new_tokens is not None:
            need(isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0,
                  f"min_new_tokens must be a Python int >= 0, got {self.min_new_tokens!r}")


#: pad_token_id / truncate_token value meaning "the tokenizer's own" (`pjit_ppo.loading.
#: resolve_token_ids` replaces it with the id before anything uses it).
FROM_TOKENIZER = -1


@dataclasses.dataclass(slots=True)
class SequenceOptions:
    """Query + response sequences and how responses are sampled and cut: the fields the PPO
    run (`ppo.*`) and reward learning (top level) share, so a reward model is trained and
    normalised on the sequences the PPO run will score. Declared once, here."""

    query_length: int = 64               # prompt tokens (left-padded / truncated to this)
    response_length: int = 24            # sampled tokens per episode (always exactly this many)
    pad_token_id: int = 50259            # pad id of queries and truncated responses; -1 =
    #                                      FROM_TOKENIZER: its pad token, else the first
    #                                      embedding row past its vocabulary
    # Sampling (in PPO the temperature also divides the logits of every training log-prob).
    temperature: float = 0.7
    top_k: int = 0                       # 0 = off
    top_p: float = 1.0                   # 1.0 = off
    top_p_mode: str = "transformers"     # see SamplingOptions.top_p_mode
    # Post-processing of responses before the reward sees them.
    truncate_token: Optional[int] = 13   # stop token id (GPT-2 '.'); None disables truncation;
    #                                      -1 = FROM_TOKENIZER: its EOS token
    truncate_after: int = 16             # only stop tokens at index >= this count

    def sampling_options(self) -> SamplingOptions:
        """The sampler's options: response_length tokens, no early stop."""
        return SamplingOptions(max_new_tokens=self.response_length, temperature=self.temperature,
                               top_k=self.top_k, top_p=self.top_p, top_p_mode=self.top_p_mode)

    def validate_sequences(self, prefix: str) -> None:
        """Checks the shared fields; `prefix` is how the user types them ("ppo." or "")."""
        for name in ("query_length", "response_length"):
            int_at_least(f"{prefix}{name}", getattr(self, name), 1)
        int_at_least(f"{prefix}pad_token_id", self.pad_token_id, FROM_TOKENIZER,
                     " (or -1: from the tokenizer)")
        positive(f"{prefix}temperature", self.temperature)
        int_at_least(f"{prefix}top_k", self.top_k, 0, " (0 = off)")
        number_in(f"{prefix}top_p", self.top_p, 0.0, 1.0, " (1.0 = off)", low_open=True)
        choice(f"{prefix}top_p_mode", self.top_p_mode, TOP_P_MODES)
        int_at_least(f"{prefix}truncate_after", self.truncate_after, 0)
        if self.truncate_token is not None:
            int_at_least(f"{prefix}truncate_token", self.truncate_token, FROM_TOKENIZER,
                         " (-1: the tokenizer's EOS; None: no truncation)")
            need(self.truncate_after < self.response_length,
                 f"{prefix}truncate_after={self.truncate_after} must be below "
                 f"{prefix}response_length={self.response_length}: a stop token only counts at "
                 f"an index >= truncate_after, so no response could ever stop; lower it, or "
                 f"set {prefix}truncate_token=None")
        try:
            self.sampling_options()
        except ConfigError as e:
            raise ConfigError(f"{prefix}{e}") from None


@dataclasses.dataclass(slots=True)
class MeshConfig:
    """Device mesh sizes; one of them may be -1 (= all remaining devices)."""

    data: int = 1      # pure data parallelism (parameters replicated)
    fsdp: int = -1     # batch and parameters sharded (ZeRO-3 style)
    tensor: int = 1    # heads / mlp / vocab sharded within a layer

    def validate(self) -> "MeshConfig":
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, value in sizes.items():
            need(isinstance(value, int) and (value >= 1 or value == -1),
                  f"mesh.{name}={value!r} must be a positive integer or -1")
        need(list(sizes.values()).count(-1) <= 1,
              f"at most one mesh axis may be -1, got {sizes}")
        return self


#: The weights LoRA adapters can sit on: every projection of the decoder's layers, as
#: parameter paths (`pjit_ppo.models.transformer`; fc_gate exists in gated MLPs only).
LORA_PROJECTIONS = ("transformer/layers/attn/q/w", "transformer/layers/attn/k/w",
                    "transformer/layers/attn/v/w", "transformer/layers/attn/o/w",
                    "transformer/layers/mlp/fc_in/w", "transformer/layers/mlp/fc_gate/w",
                    "transformer/layers/mlp/fc_out/w")
#: The default `model.lora.targets`: the attention and MLP projections, all of them.
LORA_DEFAULT_TARGETS = (r"attn/(q|k|v|o)/w$", r"mlp/fc_(in|gate|out)/w$")


@dataclasses.dataclass(slots=True)
class LoraOptions:
    """LoRA adapters (Hu et al. 2021) on the trained policy (and critic: ppo.critic_lora):
    each targeted weight W [in, out] stays frozen in the compute dtype and the layer
    computes x @ W + alpha / rank * dropout(x) @ A @ B with trainable A [in, rank]
    (random normal, std 1/sqrt(in)) and B [rank, out] (zeros: training starts at the
    base model). Only A and B have gradients and optimizer state; the reference is the
    base without them (no second copy of the weights). `pjit_ppo.models.lora`.
    """

    rank: int = 0                     # 0 = off (full fine-tuning); else the adapters' rank
    alpha: float = 16.0               # the adapters' output is scaled by alpha / rank
    targets: Tuple[str, ...] = LORA_DEFAULT_TARGETS  # regexes searched in the parameter
    #                                   paths of LORA_PROJECTIONS; each must match one
    dropout: float = 0.0              # dropout on the adapters' input in training steps
    #                                   (never in sampling, scoring or evaluation)

    def __post_init__(self):
        if isinstance(self.targets, list):
            self.targets = tuple(self.targets)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self) -> "LoraOptions":
        check_field_types(self, "model.lora.")
        int_at_least("model.lora.rank", self.rank, 0, " (0 = off)")
        positive("model.lora.alpha", self.alpha, ": the adapters' output is scaled by "
                 "alpha / rank")
        number_in("model.lora.dropout", self.dropout, 0.0, 1.0, " (0 = off)", high_open=True)
        need(len(self.targets) > 0, "model.lora.targets is empty: give regexes of the "
                                    "weights to adapt, e.g. ('attn/(q|v)/w$',)")
        for target in self.targets:
            try:
                pattern = re.compile(target)
            except re.error as e:
                raise ConfigError(f"model.lora.targets: {target!r} is not a regular "
                                  f"expression ({e})") from None
            need(any(pattern.search(p) for p in LORA_PROJECTIONS),
                 f"model.lora.targets: {target!r} matches none of the weights LoRA can adapt "
                 f"({', '.join(LORA_PROJECTIONS)})")
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
    lora: LoraOptions = dataclasses.field(default_factory=LoraOptions)  # adapters on the
    #                                   trained policy (SFT, DPO, PPO); rank 0 = off

    def __post_init__(self):
        if isinstance(self.lora, dict):  # a config read back from JSON
            self.lora = LoraOptions(**self.lora)

    def validate(self) -> "ModelOptions":
        choice("model.compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        need(isinstance(self.lora, LoraOptions),
             f"model.lora={self.lora!r} must be a LoraOptions (set its fields: "
             f"model.lora.rank=8)")
        self.lora.validate()
        need(isinstance(self.scan_unroll, int) and self.scan_unroll >= 1,
              f"model.scan_unroll={self.scan_unroll!r} must be an integer >= 1")
        need(bool(self.policy_path) or bool(self.random),
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

    kind: str = "target_tokens"       # "model" (a reward model), "target_tokens" (demo),
    #                                   "function" (Python, reward.function) or "terms"
    #                                   (weighted kinds, reward.terms); pjit_ppo/rewards/
    path: str = ""                    # HF directory of the reward trunk ("" = model.random)
    head_seed: int = 0                # reward head init N(0, 1/sqrt(d + 1)) until trained
    allow_random_head: bool = False   # kind="model": a reward.path without a trained
    #                                   reward_head.safetensors gets a random head from
    #                                   head_seed (logged as a warning) instead of an error
    target_ids: Tuple[int, ...] = (5, 6, 7)  # kind="target_tokens": the rewarded token ids
    function: str = ""                # kind="function": SPEC 'package.module:callable' or
    #                                   'path/to/file.py:callable', called on the host as
    #                                   fn(prompts, responses, **metadata) -> one float per
    #                                   row (pjit_ppo/rewards/host.py; built-ins in
    #                                   pjit_ppo.rewards.functions)
    terms: Tuple[str, ...] = ()       # kind="terms": "name:kind:weight[:arg]" entries, e.g.
    #                                   ("rm:model:1.0", "fmt:function:0.5:pkg.mod:fn"); the
    #                                   score is sum(weight x term); each term's mean is
    #                                   logged as reward/<name> (pjit_ppo/rewards/terms.py)

    def validate(self) -> "RewardOptions":
        reward_kinds.check(self)  # the kind and its own fields (pjit_ppo/rewards/<kind>.py)
        int_at_least("reward.head_seed", self.head_seed, 0)
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
        choice("data.prompts_format", self.prompts_format,
                ("auto", "jsonl", "text", "hf_dataset"))
        need(bool(self.prompt_field), "data.prompt_field is empty: name the JSONL key or "
                                       "dataset column that holds the prompt")
        need(isinstance(self.samples_every, int) and self.samples_every >= 0,
              f"data.samples_every={self.samples_every!r} must be an integer >= 0 (0 = off)")
        need(isinstance(self.samples_per_table, int) and self.samples_per_table >= 1,
              f"data.samples_per_table={self.samples_per_table!r} must be an integer >= 1")
        need(self.min_prompt_length >= 1,
              f"data.min_prompt_length={self.min_prompt_length} must be >= 1")
        need(self.low_token >= 0, f"data.low_token={self.low_token} must be >= 0")
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
        need(isinstance(self.every, int) and self.every >= 1,
              f"checkpoint.every={self.every!r} must be an integer >= 1")
        need(isinstance(self.keep, int) and self.keep >= 1,
              f"checkpoint.keep={self.keep!r} must be an integer >= 1")
        need(isinstance(self.keep_period, int) and self.keep_period >= 0,
              f"checkpoint.keep_period={self.keep_period!r} must be an integer >= 0 (0 = off)")
        return self


#: Evaluation prompts when evaluation.num_prompts is 0 and no smaller prompt set limits them.
DEFAULT_EVAL_PROMPTS = 256


@dataclasses.dataclass(slots=True)
class EvalOptions:
    """Evaluation of a checkpoint (launch/evaluate.py): held-out prompts, both policies."""

    num_prompts: int = 0              # evaluation prompts (from their own random stream);
    #                                   0 = the held-out prompt set once, at most 256 (256
    #                                   random prompts without a prompt file); more than the
    #                                   set holds repeats prompts (eval.json says so)
    temperature: float = 0.0          # sampling temperature; 0 = ppo.temperature
    greedy: bool = False              # argmax decoding instead of sampling
    seed: int = 0                     # seed of the evaluation prompts and samples
    kl: bool = True                   # KL(policy || reference) of the policy's samples
    #                                   (two more passes over every sample: about half of
    #                                   the evaluation's work); False writes kl_mean null

    def validate(self) -> "EvalOptions":
        int_at_least("evaluation.num_prompts", self.num_prompts, 0,
                     " (0: the held-out set once, at most 256)")
        finite_number("evaluation.temperature", self.temperature)
        need(self.temperature >= 0, f"evaluation.temperature={self.temperature} must be > 0, "
                                     f"or 0 for ppo.temperature")
        int_at_least("evaluation.seed", self.seed, 0)
        need(isinstance(self.kl, bool), f"evaluation.kl={self.kl!r} must be True or False")
        return self


@dataclasses.dataclass(slots=True)
class ProfileOptions:
    """A jax.profiler trace of chosen iterations into WORKDIR/profile/ (TensorBoard's
    profile plugin or Perfetto open it)."""

    start: int = 0                    # first traced iteration, numbered as in metrics.jsonl
    #                                   (1 = the first; its compile is not traced); 0 = off
    iterations: int = 1               # how many iterations the trace covers

    def validate(self) -> "ProfileOptions":
        need(isinstance(self.start, int) and self.start >= 0,
              f"profile.start={self.start!r} must be an integer >= 0 (0 = no trace)")
        need(isinstance(self.iterations, int) and self.iterations >= 1,
              f"profile.iterations={self.iterations!r} must be an integer >= 1")
        return self


