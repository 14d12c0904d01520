"""The supervised fine-tuning stage: next-token training of the decoder on a text corpus.

`train(config, workdir)` runs the stage and writes WORKDIR/model/, an HF directory that
the next stage's `model.policy_path` reads.
"""
from pjit_ppo.sft.train import MODEL_DIR, lr_schedule, token_loss_sums, train

__all__ = ["train", "token_loss_sums", "lr_schedule", "MODEL_DIR"]
