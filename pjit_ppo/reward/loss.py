"""The reward model's training loss: softmax cross-entropy over the N rewards of a label.

For N = 2 this is Bradley-Terry: -log sigmoid(r_chosen - r_rejected).
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp


def preference_loss(rewards: jax.Array, choice: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """Per-label loss and correctness.

    Args:
      rewards: float [B, N], the reward of each of a label's N responses (the logits).
      choice: int [B], the index the labeller chose.
    Returns:
      (loss float32 [B] = logsumexp(rewards) - rewards[choice],
       correct float32 [B] = 1 where the chosen response is the argmax of the
       rewards, the first one on ties: lm-human-preferences' accuracy).
    """
    rewards = rewards.astype(jnp.float32)
    picked = jnp.take_along_axis(rewards, choice[:, None].astype(jnp.int32), axis=1)[:, 0]
    loss = jax.nn.logsumexp(rewards, axis=1) - picked
    correct = (jnp.argmax(rewards, axis=1) == choice).astype(jnp.float32)
    return loss, correct
