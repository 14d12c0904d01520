"""Typed configs of the two stages before PPO: supervised fine-tuning and reward learning.

A recipe file defines `get_config(arg="") -> SFTConfig` (or `RewardLearningConfig`);
the entry points (`launch/train_sft.py`, `launch/train_reward.py`) read it with
`ml_collections.config_flags` and apply dotted overrides (`--config.lr=1e-4`,
`--config.model.policy_path=DIR`). Every field is documented where it is defined.
The classes use `__slots__`, so a misspelt field fails instead of being ignored, and
`validate()` raises `pjit_ppo.config.ConfigError` naming the field, its value and the fix.

The mesh (`MeshConfig`) and model (`ModelOptions`) sections are the PPO run config's,
so a stage runs on the same mesh with the same partition rules and model options.
"""
import dataclasses
from typing import Any, Dict, Optional

from pjit_ppo.config import (COMPUTE_DTYPES, OPTIMIZERS, TOP_P_MODES, ConfigError, MeshConfig,
                             ModelOptions)

#: Allowed values of the enum-like fields.
CORPUS_FORMATS = ("auto", "jsonl", "text")
LR_DECAYS = ("cosine", "linear", "constant")
PROMPT_FORMATS = ("auto", "jsonl", "text", "hf_dataset")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _int_at_least(field: str, value: Any, low: int) -> None:
    _need(isinstance(value, int) and not isinstance(value, bool) and value >= low,
          f"{field}={value!r} must be an integer >= {low}")


def _number_in(field: str, value: Any, low: float, high: float, fix: str = "") -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    _need(ok, f"{field}={value!r} must be a number in [{low}, {high}]{fix}")


def _choice(field: str, value: Any, allowed) -> None:
    _need(value in allowed, f"{field}={value!r}; choose one of {', '.join(map(repr, allowed))}")


@dataclasses.dataclass(slots=True)
class SFTConfig:
    """Supervised fine-tuning (next-token prediction) of the decoder on a text corpus.

    Output: WORKDIR/model/ (an HF model directory: config.json + model.safetensors,
    and the tokenizer's files when a tokenizer was used), WORKDIR/config.json,
    WORKDIR/metrics.jsonl and WORKDIR/tensorboard/ (see pjit_ppo/sft.py).
    """

    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    # The model to train: model.policy_path (an HF directory) or model.random (an HF
    # config dict, random init with `seed`); model.compute_dtype etc. apply as in PPO.

    # Data.
    data_path: str = ""               # the corpus: JSONL (one record per line) or plain text
    #                                   (one document per non-empty line)
    data_format: str = "auto"         # "auto" (*.jsonl / *.json -> jsonl, else text), "jsonl",
    #                                   "text"
    text_field: str = "text"          # JSONL: key of a record trained on in full
    prompt_field: str = "prompt"      # JSONL: records with prompt_field + completion_field
    completion_field: str = "completion"  # train on the completion only (prompt loss masked)
    eval_path: str = ""               # held-out corpus (same format); "" = hold out
    #                                   eval_fraction of data_path
    eval_fraction: float = 0.05       # share of data_path held out when eval_path is ""
    max_eval_examples: int = 1024     # held-out sequences scored per evaluation (first ones)
    tokenizer_path: str = ""          # HF tokenizer directory; "" = model.policy_path
    seq_length: int = 128             # tokens per training sequence (longer ones are cut)
    packing: bool = False             # concatenate documents (EOS-separated) and cut into
    #                                   seq_length blocks, instead of one document per row
    append_eos: bool = True           # end each document with the tokenizer's EOS token

    # Optimisation: AdamW, linear warm-up then cosine / linear decay (or constant).
    batch_size: int = 32              # sequences per optimizer step, global over all devices
    gradient_accumulation_steps: int = 1  # micro-batches per step (a memory knob only)
    num_epochs: int = 1               # passes over the training set (a fresh shuffle each)
    max_steps: int = 0                # > 0: stop after this many steps (the LR schedule
    #                                   spans them); 0 = num_epochs over the data
    lr: float = 1e-4                  # peak learning rate
    warmup_steps: int = 0             # linear warm-up from 0 to lr
    lr_decay: str = "cosine"          # after warm-up: "cosine" / "linear" to end_lr_fraction *
    #                                   lr at the last step, or "constant"
    end_lr_fraction: float = 0.0      # final LR as a fraction of lr
    weight_decay: float = 0.01        # decoupled (AdamW); applied to weight matrices and
    #                                   embeddings only, not to biases or norm scales
    b1: float = 0.9                   # Adam beta1
    b2: float = 0.999                 # Adam beta2
    eps: float = 1e-8                 # Adam epsilon
    max_grad_norm: Optional[float] = 1.0  # global-norm gradient clipping; None = off

    # Logging and output.
    log_every: int = 10               # steps between train/* metric lines (means since the last)
    eval_every: int = 100             # steps between held-out evaluations (also at step 0 and
    #                                   at the end); 0 = only at step 0 and the end
    save_dtype: str = "float32"       # dtype of the saved weights
    tensorboard: bool = True          # also write TensorBoard event files
    seed: int = 0                     # shuffling, the held-out split and random init

    def validate(self) -> "SFTConfig":
        """Checks every field; raises ConfigError naming the field and the fix."""
        self.mesh.validate()
        self.model.validate()
        _need(bool(self.data_path), "data_path is empty: point it at a JSONL or text corpus")
        _choice("data_format", self.data_format, CORPUS_FORMATS)
        _need(bool(self.tokenizer_path or self.model.policy_path),
              "tokenizer_path is empty and so is model.policy_path: set tokenizer_path to an "
              "HF tokenizer directory")
        _number_in("eval_fraction", self.eval_fraction, 0.0, 0.5)
        if not self.eval_path:
            _need(self.eval_fraction > 0, "eval_fraction=0 and no eval_path: give a held-out "
                                          "corpus (eval_path) or a fraction in (0, 0.5]")
        for name, low in (("max_eval_examples", 1), ("seq_length", 2), ("batch_size", 1),
                          ("gradient_accumulation_steps", 1), ("num_epochs", 1),
                          ("max_steps", 0), ("warmup_steps", 0), ("log_every", 1),
                          ("eval_every", 0)):
            _int_at_least(name, getattr(self, name), low)
        _need(self.batch_size % self.gradient_accumulation_steps == 0,
              f"batch_size={self.batch_size} is not divisible by gradient_accumulation_steps="
              f"{self.gradient_accumulation_steps}")
        _number_in("lr", self.lr, 0.0, 1.0)
        _choice("lr_decay", self.lr_decay, LR_DECAYS)
        _number_in("end_lr_fraction", self.end_lr_fraction, 0.0, 1.0)
        _number_in("weight_decay", self.weight_decay, 0.0, 1.0)
        _number_in("b1", self.b1, 0.0, 1.0)
        _number_in("b2", self.b2, 0.0, 1.0)
        _number_in("eps", self.eps, 0.0, 1.0)
        _need(self.eps > 0, f"eps={self.eps} must be > 0")
        if self.max_grad_norm is not None:
            _number_in("max_grad_norm", self.max_grad_norm, 0.0, float("inf"),
                       " (or None to disable clipping)")
            _need(self.max_grad_norm > 0, f"max_grad_norm={self.max_grad_norm} must be > 0 "
                                          f"(or None to disable clipping)")
        _choice("save_dtype", self.save_dtype, COMPUTE_DTYPES)
        return self

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready nested dict of every field."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True)
class RewardLearningConfig:
    """Reward learning from preference labels (lm-human-preferences' train_reward).

    Output: WORKDIR/reward_model/ (config.json + model.safetensors of the trunk and the
    unused LM head, reward_head.safetensors with w, b, gain and bias, reward_model.json,
    the tokenizer), WORKDIR/config.json, metrics.jsonl and tensorboard/
    (see pjit_ppo/reward_learning.py).
    """

    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    # model.policy_path: the *pretrained policy* (HF directory) whose samples set the
    # reward normalisation, and by default the reward model's starting point;
    # model.random: a random one (tests).
    init_path: str = ""               # HF LM directory the reward trunk starts from;
    #                                   "" = model.policy_path
    head_seed: int = 0                # reward head init N(0, 1/sqrt(d_model + 1))

    # Labels: JSONL, best-of-N {"query", "responses", "choice"} or pairwise
    # {"query", "chosen", "rejected"} (pjit_ppo/data/preferences.py).
    labels_path: str = ""             # training labels
    test_labels_path: str = ""        # held-out labels; "" = hold out test_fraction of them
    test_fraction: float = 0.1        # share of labels_path held out when no test file
    tokenizer_path: str = ""          # HF tokenizer directory; "" = model.policy_path
    start_text: str = ""              # queries start after its first occurrence (if set)
    end_text: str = ""                # queries end after its last occurrence (if set)

    # Sequence shapes and sampling: set these like the PPO run that uses the model.
    query_length: int = 64            # query tokens (left-padded, the last ones kept)
    response_length: int = 24         # response tokens (right-padded / truncated)
    pad_token_id: int = 50259         # the PPO run's ppo.pad_token_id
    temperature: float = 0.7          # normalisation samples: the PPO sampling settings
    top_k: int = 0
    top_p: float = 1.0
    top_p_mode: str = "transformers"
    truncate_token: Optional[int] = 13  # samples are truncated after it (index >=
    truncate_after: int = 16           # truncate_after) before scoring, as in PPO

    # Training.
    num_epochs: int = 1               # passes over the labels (a fresh shuffle each)
    batch_size: int = 32              # labels per optimizer step, global
    gradient_accumulation_steps: int = 1  # micro-batches per step (a memory knob only)
    lr: float = 5e-5                  # annealed linearly to 0 over the run's steps
    eps: float = 1e-5                 # Adam epsilon
    optimizer: str = "tf_adam"        # "tf_adam" (eps on the uncorrected moment) or "adam"
    max_grad_norm: Optional[float] = None  # global-norm gradient clipping; None = off
    log_every: int = 10               # steps between train/* lines (means since the last)
    eval_every: int = 50              # steps between held-out evaluations (and at the end);
    #                                   0 = only at the end

    # Normalisation (before and after training): gain and bias are set so that the
    # rewards of policy samples have mean norm_target_mean and std norm_target_std.
    normalize_before: bool = True
    normalize_after: bool = True
    norm_samples: int = 256           # (query, sampled response) pairs per measurement
    norm_batch_size: int = 64         # rows sampled at once
    norm_prompts_path: str = ""       # prompts to sample from (JSONL / text / saved HF
    #                                   dataset); "" = the training labels' queries
    norm_prompts_format: str = "auto"
    norm_prompt_field: str = "prompt"
    norm_target_mean: float = 0.0
    norm_target_std: float = 1.0

    save_dtype: str = "float32"       # dtype of the saved trunk weights
    tensorboard: bool = True          # also write TensorBoard event files
    seed: int = 0                     # shuffling, the held-out split, sampling, random init

    def validate(self) -> "RewardLearningConfig":
        """Checks every field; raises ConfigError naming the field and the fix."""
        self.mesh.validate()
        self.model.validate()
        _need(bool(self.labels_path), "labels_path is empty: point it at a JSONL file of "
                                      "preference labels")
        _need(bool(self.tokenizer_path or self.model.policy_path),
              "tokenizer_path is empty and so is model.policy_path: set tokenizer_path to an "
              "HF tokenizer directory")
        _number_in("test_fraction", self.test_fraction, 0.0, 0.5)
        if not self.test_labels_path:
            _need(self.test_fraction > 0, "test_fraction=0 and no test_labels_path: give "
                                          "held-out labels or a fraction in (0, 0.5]")
        for name, low in (("query_length", 1), ("response_length", 1), ("pad_token_id", 0),
                          ("top_k", 0), ("truncate_after", 0), ("num_epochs", 1),
                          ("batch_size", 1), ("gradient_accumulation_steps", 1),
                          ("log_every", 1), ("eval_every", 0), ("norm_samples", 2),
                          ("norm_batch_size", 1)):
            _int_at_least(name, getattr(self, name), low)
        _need(self.batch_size % self.gradient_accumulation_steps == 0,
              f"batch_size={self.batch_size} is not divisible by gradient_accumulation_steps="
              f"{self.gradient_accumulation_steps}")
        _number_in("temperature", self.temperature, 0.0, float("inf"))
        _need(self.temperature > 0, f"temperature={self.temperature} must be > 0")
        _number_in("top_p", self.top_p, 0.0, 1.0)
        _need(self.top_p > 0, f"top_p={self.top_p} must be in (0, 1]")
        _choice("top_p_mode", self.top_p_mode, TOP_P_MODES)
        if self.truncate_token is not None:
            _int_at_least("truncate_token", self.truncate_token, 0)
        _number_in("lr", self.lr, 0.0, 1.0)
        _number_in("eps", self.eps, 0.0, 1.0)
        _need(self.eps > 0, f"eps={self.eps} must be > 0")
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.max_grad_norm is not None:
            _number_in("max_grad_norm", self.max_grad_norm, 0.0, float("inf"))
            _need(self.max_grad_norm > 0, f"max_grad_norm={self.max_grad_norm} must be > 0 "
                                          f"(or None to disable clipping)")
        _choice("norm_prompts_format", self.norm_prompts_format, PROMPT_FORMATS)
        _number_in("norm_target_std", self.norm_target_std, 0.0, float("inf"))
        _need(self.norm_target_std > 0, f"norm_target_std={self.norm_target_std} must be > 0")
        _number_in("norm_target_mean", self.norm_target_mean, float("-inf"), float("inf"))
        _choice("save_dtype", self.save_dtype, COMPUTE_DTYPES)
        return self

    @property
    def reward_init_path(self) -> str:
        """The HF directory the reward trunk starts from ("" = random from model.random)."""
        return self.init_path or self.model.policy_path

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready nested dict of every field."""
        return dataclasses.asdict(self)
