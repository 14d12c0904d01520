"""The SFT stage's config (`SFTConfig`): next-token training on a corpus.

A recipe file defines `get_config(arg="") -> SFTConfig`; `launch/train_sft.py` applies
dotted overrides (`--config.lr=1e-4`, `--config.model.policy_path=DIR`).
"""
import dataclasses
from typing import Any, Dict, Optional

from pjit_ppo.config.checks import (check_types_and_finiteness, choice, int_at_least, need,
                                    number_in)
from pjit_ppo.config.sections import (COMPUTE_DTYPES, CheckpointOptions, MeshConfig,
                                      ModelOptions)

#: Allowed values of the enum-like fields.
CORPUS_FORMATS = ("auto", "jsonl", "text")
LR_DECAYS = ("cosine", "linear", "constant")


@dataclasses.dataclass(slots=True)
class SFTConfig:
    """Supervised fine-tuning (next-token prediction) of the decoder on a text corpus.

    Output: WORKDIR/model/ (an HF model directory: config.json + model.safetensors,
    and the tokenizer's files when a tokenizer was used), WORKDIR/config.json,
    WORKDIR/metrics.jsonl and WORKDIR/tensorboard/ (see pjit_ppo/sft/).
    """

    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    checkpoint: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    # checkpoint: Orbax checkpoints of the train state every `checkpoint.every` steps in
    # WORKDIR/checkpoints/<step>/; re-running the same command resumes from the latest.
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
        check_types_and_finiteness(self)
        self.mesh.validate()
        self.model.validate()
        self.checkpoint.validate()
        need(bool(self.data_path), "data_path is empty: point it at a JSONL or text corpus")
        choice("data_format", self.data_format, CORPUS_FORMATS)
        need(bool(self.tokenizer_path or self.model.policy_path),
              "tokenizer_path is empty and so is model.policy_path: set tokenizer_path to an "
              "HF tokenizer directory")
        number_in("eval_fraction", self.eval_fraction, 0.0, 0.5)
        if not self.eval_path:
            need(self.eval_fraction > 0, "eval_fraction=0 and no eval_path: give a held-out "
                                          "corpus (eval_path) or a fraction in (0, 0.5]")
        for name, low in (("max_eval_examples", 1), ("seq_length", 2), ("batch_size", 1),
                          ("gradient_accumulation_steps", 1), ("num_epochs", 1),
                          ("max_steps", 0), ("warmup_steps", 0), ("log_every", 1),
                          ("eval_every", 0)):
            int_at_least(name, getattr(self, name), low)
        need(self.batch_size % self.gradient_accumulation_steps == 0,
              f"batch_size={self.batch_size} is not divisible by gradient_accumulation_steps="
              f"{self.gradient_accumulation_steps}")
        number_in("lr", self.lr, 0.0, 1.0)
        choice("lr_decay", self.lr_decay, LR_DECAYS)
        number_in("end_lr_fraction", self.end_lr_fraction, 0.0, 1.0)
        number_in("weight_decay", self.weight_decay, 0.0, 1.0)
        number_in("b1", self.b1, 0.0, 1.0, high_open=True)
        number_in("b2", self.b2, 0.0, 1.0, high_open=True)
        number_in("eps", self.eps, 0.0, 1.0)
        need(self.eps > 0, f"eps={self.eps} must be > 0")
        if self.max_grad_norm is not None:
            number_in("max_grad_norm", self.max_grad_norm, 0.0, float("inf"),
                       " (or None to disable clipping)")
            need(self.max_grad_norm > 0, f"max_grad_norm={self.max_grad_norm} must be > 0 "
                                          f"(or None to disable clipping)")
        choice("save_dtype", self.save_dtype, COMPUTE_DTYPES)
        int_at_least("seed", self.seed, 0)
        return self

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready nested dict of every field."""
        return dataclasses.asdict(self)
