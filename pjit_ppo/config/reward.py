"""The reward-learning stage's config (`RewardLearningConfig`): a reward model from
preference labels, sharing the PPO run's sequence fields (`SequenceOptions`).

A recipe file defines `get_config(arg="") -> RewardLearningConfig`;
`launch/train_reward.py` applies dotted overrides (`--config.lr=1e-5`).
"""
import dataclasses
from typing import Any, Dict, Optional

from pjit_ppo.config.checks import (check_types_and_finiteness, choice, int_at_least, need,
                                    number_in)
from pjit_ppo.config.sections import (COMPUTE_DTYPES, OPTIMIZERS, PROMPT_FORMATS,
                                      CheckpointOptions, MeshConfig, ModelOptions,
                                      SequenceOptions)


@dataclasses.dataclass(slots=True)
class RewardLearningConfig(SequenceOptions):
    """Reward learning from preference labels (lm-human-preferences' train_reward).

    Output: WORKDIR/reward_model/ (config.json + model.safetensors of the trunk and the
    unused LM head, reward_head.safetensors with w, b, gain and bias, reward_model.json,
    the tokenizer), WORKDIR/config.json, metrics.jsonl and tensorboard/
    (see pjit_ppo/reward/).

    The sequence fields (query_length, response_length, pad_token_id, temperature,
    top_k, top_p, top_p_mode, truncate_token, truncate_after) are `SequenceOptions`',
    the same fields as the PPO run's `ppo.*`: set them like the PPO run that uses the
    model (labels are tokenised to these shapes; normalisation samples are drawn and
    truncated with these settings).
    """

    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    checkpoint: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    # checkpoint: Orbax checkpoints of the train state every `checkpoint.every` steps in
    # WORKDIR/checkpoints/<step>/; re-running the same command resumes from the latest.
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
        check_types_and_finiteness(self)
        self.mesh.validate()
        self.model.validate()
        need(not self.model.lora.enabled,
             f"model.lora.rank={self.model.lora.rank}: reward learning trains the whole reward "
             f"model; LoRA adapters apply to SFT, DPO and PPO. Set model.lora.rank=0")
        self.checkpoint.validate()
        need(bool(self.labels_path), "labels_path is empty: point it at a JSONL file of "
                                      "preference labels")
        need(bool(self.tokenizer_path or self.model.policy_path),
              "tokenizer_path is empty and so is model.policy_path: set tokenizer_path to an "
              "HF tokenizer directory")
        number_in("test_fraction", self.test_fraction, 0.0, 0.5)
        if not self.test_labels_path:
            need(self.test_fraction > 0, "test_fraction=0 and no test_labels_path: give "
                                          "held-out labels or a fraction in (0, 0.5]")
        self.validate_sequences("")
        for name, low in (("num_epochs", 1), ("batch_size", 1), ("gradient_accumulation_steps", 1),
                          ("log_every", 1), ("eval_every", 0), ("norm_samples", 2),
                          ("norm_batch_size", 1), ("head_seed", 0), ("seed", 0)):
            int_at_least(name, getattr(self, name), low)
        need(self.batch_size % self.gradient_accumulation_steps == 0,
             f"batch_size={self.batch_size} is not divisible by gradient_accumulation_steps="
             f"{self.gradient_accumulation_steps}")
        number_in("lr", self.lr, 0.0, 1.0)
        number_in("eps", self.eps, 0.0, 1.0)
        need(self.eps > 0, f"eps={self.eps} must be > 0")
        choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.max_grad_norm is not None:
            number_in("max_grad_norm", self.max_grad_norm, 0.0, float("inf"))
            need(self.max_grad_norm > 0, f"max_grad_norm={self.max_grad_norm} must be > 0 "
                                          f"(or None to disable clipping)")
        choice("norm_prompts_format", self.norm_prompts_format, PROMPT_FORMATS)
        number_in("norm_target_std", self.norm_target_std, 0.0, float("inf"))
        need(self.norm_target_std > 0, f"norm_target_std={self.norm_target_std} must be > 0")
        number_in("norm_target_mean", self.norm_target_mean, float("-inf"), float("inf"))
        choice("save_dtype", self.save_dtype, COMPUTE_DTYPES)
        return self

    @property
    def reward_init_path(self) -> str:
        """The HF directory the reward trunk starts from ("" = random from model.random)."""
        return self.init_path or self.model.policy_path

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready nested dict of every field."""
        return dataclasses.asdict(self)
