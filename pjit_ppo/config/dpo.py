"""The DPO stage's config (`DPOConfig`): direct preference optimisation of the policy on
the preference labels reward learning reads, sharing the PPO run's sequence fields
(`SequenceOptions`).

A recipe file defines `get_config(arg="") -> DPOConfig`; `launch/train_dpo.py` applies
dotted overrides (`--config.beta=0.05`, `--config.model.policy_path=DIR`).
"""
import dataclasses
from typing import Any, Dict, Optional

from pjit_ppo.config.checks import (check_types_and_finiteness, choice, int_at_least, need,
                                    number_in, positive)
from pjit_ppo.config.sections import (COMPUTE_DTYPES, OPTIMIZERS, CheckpointOptions,
                                      MeshConfig, ModelOptions, SequenceOptions)

#: Allowed values of `DPOConfig.loss_type`: "sigmoid" (DPO, Rafailov et al. 2023; with
#: label_smoothing > 0 the conservative variant cDPO) and "ipo" (Azar et al. 2023).
DPO_LOSS_TYPES = ("sigmoid", "ipo")


@dataclasses.dataclass(slots=True)
class DPOConfig(SequenceOptions):
    """Direct preference optimisation (DPO / IPO) of a policy on preference labels.

    The policy starts from model.policy_path (or model.random); the reference is that
    initial policy, frozen in model.compute_dtype. Labels are the reward-learning files:
    pairwise {query, chosen, rejected} or best-of-N {query, responses, choice}, a
    best-of-N label giving N - 1 pairs (chosen = the choice, rejected = each other
    response). The loss compares summed response log-probs (at temperature 1) of the
    policy and the reference (`pjit_ppo.dpo.dpo_loss`).

    Output: WORKDIR/model/ (an HF model directory with the tokenizer's files, for PPO's
    model.policy_path, evaluation or export), WORKDIR/config.json, metrics.jsonl,
    tensorboard/, checkpoints/ and reference_logps.npz (see pjit_ppo/dpo/).

    Of the sequence fields (`SequenceOptions`), query_length, response_length and
    pad_token_id shape the tokenised labels (queries left-padded and cut to their last
    query_length tokens, responses right-padded and cut to response_length; -1 = the
    tokenizer's pad). DPO samples nothing: the sampling fields (temperature, top_k,
    top_p, top_p_mode, truncate_token, truncate_after) are validated and recorded so a
    DPO recipe can share the PPO run's sequence section, and do not change training.
    """

    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    checkpoint: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    # checkpoint: Orbax checkpoints of the train state every `checkpoint.every` steps in
    # WORKDIR/checkpoints/<step>/; re-running the same command resumes from the latest.
    # model.policy_path: the policy to train (HF directory), also the reference;
    # model.random: a random one (tests).

    # Labels: JSONL, best-of-N {"query", "responses", "choice"} or pairwise
    # {"query", "chosen", "rejected"} (pjit_ppo/data/preferences.py).
    labels_path: str = ""             # training labels
    test_labels_path: str = ""        # held-out labels; "" = hold out test_fraction of them
    test_fraction: float = 0.1        # share of labels_path held out when no test file
    tokenizer_path: str = ""          # HF tokenizer directory; "" = model.policy_path
    start_text: str = ""              # queries start after its first occurrence (if set)
    end_text: str = ""                # queries end after its last occurrence (if set)

    # The objective.
    beta: float = 0.1                 # the KL weight: implicit reward = beta * (log pi -
    #                                   log pi_ref) of a response; > 0
    loss_type: str = "sigmoid"        # "sigmoid" (DPO) or "ipo"
    label_smoothing: float = 0.0      # sigmoid only: the assumed share of flipped labels
    #                                   (conservative DPO), in [0, 0.5)
    precompute_ref: bool = True       # True: the reference's log-probs of every pair are
    #                                   computed once before training (and saved in
    #                                   WORKDIR/reference_logps.npz), and the reference is
    #                                   then freed; False: the reference stays in memory and
    #                                   scores each batch as it is trained on

    # Optimisation: Adam, lr linear to 0 over the run (or constant), gradient clipping.
    num_epochs: int = 1               # passes over the pairs (a fresh shuffle each)
    max_steps: int = 0                # > 0: stop after this many steps (the LR anneal spans
    #                                   them); 0 = num_epochs over the pairs
    batch_size: int = 32              # preference pairs per optimizer step, global
    gradient_accumulation_steps: int = 1  # micro-batches per step (a memory knob only)
    lr: float = 1e-6                  # peak learning rate
    anneal_lr: bool = True            # linear decay to 0 at the last step; False = constant
    optimizer: str = "adam"           # "adam" (optax/PyTorch eps) or "tf_adam"
    b1: float = 0.9                   # Adam beta1
    b2: float = 0.999                 # Adam beta2
    eps: float = 1e-8                 # Adam epsilon
    max_grad_norm: Optional[float] = 1.0  # global-norm gradient clipping; None = off

    # Logging and output.
    log_every: int = 10               # steps between train/* lines (means since the last)
    eval_every: int = 50              # steps between held-out evaluations (also at step 0
    #                                   and at the end); 0 = only at step 0 and the end
    save_dtype: str = "float32"       # dtype of the saved weights
    tensorboard: bool = True          # also write TensorBoard event files
    seed: int = 0                     # shuffling, the held-out split, random init

    def validate(self) -> "DPOConfig":
        """Checks every field; raises ConfigError naming the field and the fix."""
        check_types_and_finiteness(self)
        self.mesh.validate()
        self.model.validate()
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
        positive("beta", self.beta)
        choice("loss_type", self.loss_type, DPO_LOSS_TYPES)
        number_in("label_smoothing", self.label_smoothing, 0.0, 0.5, " (0 = plain DPO)",
                  high_open=True)
        need(self.loss_type == "sigmoid" or self.label_smoothing == 0,
             f"label_smoothing={self.label_smoothing} applies to loss_type='sigmoid' only; "
             f"set it to 0 for loss_type={self.loss_type!r}")
        for name, low in (("num_epochs", 1), ("max_steps", 0), ("batch_size", 1),
                          ("gradient_accumulation_steps", 1), ("log_every", 1),
                          ("eval_every", 0), ("seed", 0)):
            int_at_least(name, getattr(self, name), low)
        need(self.batch_size % self.gradient_accumulation_steps == 0,
             f"batch_size={self.batch_size} is not divisible by gradient_accumulation_steps="
             f"{self.gradient_accumulation_steps}")
        number_in("lr", self.lr, 0.0, 1.0)
        choice("optimizer", self.optimizer, OPTIMIZERS)
        number_in("b1", self.b1, 0.0, 1.0, high_open=True)
        number_in("b2", self.b2, 0.0, 1.0, high_open=True)
        number_in("eps", self.eps, 0.0, 1.0, low_open=True)
        if self.max_grad_norm is not None:
            positive("max_grad_norm", self.max_grad_norm, " (or None to disable clipping)")
        choice("save_dtype", self.save_dtype, COMPUTE_DTYPES)
        return self

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready nested dict of every field."""
        return dataclasses.asdict(self)
