"""A PPO TrainState as the named pytrees of a checkpoint (pjit_ppo/checkpoint.py), and back.

The items, one directory each in WORKDIR/checkpoints/<iteration>/:

  policy/      the policy parameters (restorable alone: evaluation, export)
  rest/        the other trainable parameters (critic, or the shared trunk's value
               head); absent with a critic-free estimator
  opt_state/   the optimizer state
  train/       {"kl_coef": float32 [], "iteration": int32 []}
"""
from __future__ import annotations

from typing import Any, Dict

from pjit_ppo.ppo.types import TrainState


def to_items(state: TrainState) -> Dict[str, Any]:
    """{"policy", "rest", "opt_state", "train"} of `state` (arrays or ShapeDtypeStructs,
    unchanged; "rest" is {} when only the policy trains)."""
    params = dict(state.params)
    policy = params.pop("policy")
    return {"policy": policy, "rest": params, "opt_state": state.opt_state,
            "train": {"kl_coef": state.kl_coef, "iteration": state.iteration}}


def from_items(items: Dict[str, Any]) -> TrainState:
    """The TrainState whose `to_items` is `items` (the inverse of `to_items`)."""
    return TrainState({"policy": items["policy"], **dict(items["rest"])}, items["opt_state"],
                      items["train"]["kl_coef"], items["train"]["iteration"])
