"""Summed response log-probs of DPO pairs, and the reference model that scores them.

`pair_logps` is the one model pass of the stage (policy and reference alike): query +
response through the decoder with the fused LM head and token log-prob
(`pjit_ppo.models.scoring.response_logprobs`), chosen and rejected in one batch of 2B.

The reference is the initial policy (`reference_params`: a frozen copy in the compute
dtype; with LoRA adapters the base model without them: the frozen base the adapters
train on, no second copy). Its log-probs are either computed once for every pair before
training (`score_pairs`, saved in WORKDIR/reference_logps.npz so a resumed run reads
them back) or per batch while training (`logps_fn`, the reference kept in memory).
"""
from __future__ import annotations

import io
import json
import os
from typing import Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pjit_ppo import sharding, supervised
from pjit_ppo.models import assemble, scoring

#: The reference log-probs in the work directory (precompute_ref=True).
REFERENCE_FILE = "reference_logps.npz"
#: Batch keys holding the reference's log-probs of each pair.
REF_KEYS = ("ref_chosen", "ref_rejected")


def pair_logps(model_cfg, params, batch: Mapping[str, jax.Array]) -> Tuple[jax.Array, jax.Array]:
    """Summed log-probs (temperature 1) of each pair's chosen and rejected response.

    batch: query int32 [B, Q] left-padded, query_mask bool [B, Q], chosen / rejected
    int32 [B, R] right-padded, chosen_mask / rejected_mask bool [B, R].
    Returns (chosen, rejected): float32 [B] each, sums over the real response tokens.
    """
    query = jnp.concatenate([batch["query"], batch["query"]], axis=0)
    query_mask = jnp.concatenate([batch["query_mask"], batch["query_mask"]], axis=0)
    response = jnp.concatenate([batch["chosen"], batch["rejected"]], axis=0)
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0)
    logprobs = scoring.response_logprobs(model_cfg, params, query, query_mask, response, 1.0,
                                         mask)
    sums = jnp.sum(jnp.where(mask, logprobs, 0.0), axis=1)
    b = batch["query"].shape[0]
    return sums[:b], sums[b:]


def reference_params(initial_params, compute_dtype: str, *, lora_base=None):
    """The reference model's parameters: a frozen copy of the initial policy in the compute
    dtype (new buffers: the trained params are donated every step). With LoRA,
    `lora_base` (the frozen base the adapters train on) is the reference itself: the
    initial policy is the base without adapters, and no copy is made."""
    if lora_base is not None:
        return lora_base
    return assemble.make_frozen(initial_params, compute_dtype)


def logps_fn(model_cfg, mesh, *, stacked: bool):
    """A jitted `(reference params, batch) -> {"ref_chosen", "ref_rejected"}`.

    stacked=False: batch arrays [B, ...] split over the batch axes on dim 0, outputs
    float32 [B]; stacked=True: the train step's batch [micro_batches, B / micro_batches,
    ...] split on dim 1, scored one micro-batch at a time, outputs [micro_batches,
    B / micro_batches].
    """
    axes = sharding.DEFAULT_AXIS_RULES["batch"]
    out = NamedSharding(mesh, P(None, axes) if stacked else P(axes))

    def one(params, batch):
        chosen, rejected = pair_logps(model_cfg, params, batch)
        return {"ref_chosen": chosen, "ref_rejected": rejected}

    def fn(params, batch):
        if stacked:
            return jax.lax.map(lambda mb: one(params, mb), batch)
        return one(params, batch)
    return jax.jit(fn, out_shardings=out)


def score_pairs(model_cfg, mesh, params, arrays: Mapping[str, np.ndarray],
                batch_size: int) -> Dict[str, np.ndarray]:
    """The reference log-probs of every pair: {"ref_chosen", "ref_rejected"}, float32 [P]
    host arrays, scored batch_size pairs at a time (a multiple of the batch devices)."""
    fn = logps_fn(model_cfg, mesh, stacked=False)
    n = len(arrays["weight"])
    parts = {key: [] for key in REF_KEYS}
    for batch in supervised.padded_batches(dict(arrays), batch_size, "weight"):
        out = jax.device_get(fn(params, supervised.put_batch(mesh, batch)))
        for key in REF_KEYS:
            parts[key].append(np.asarray(out[key], np.float32))
    return {key: np.concatenate(parts[key])[:n] for key in REF_KEYS}


def save(path: str, logps: Mapping[str, Mapping[str, np.ndarray]], source: Dict) -> None:
    """Writes {split: {"ref_chosen", "ref_rejected"}} and `source` (what they were computed
    from) to `path` atomically (process 0 only)."""
    if jax.process_index() != 0:
        return
    arrays = {f"{split}/{key}": np.asarray(v, np.float32)
              for split, values in logps.items() for key, v in values.items()}
    arrays["source"] = np.asarray(json.dumps(source, sort_keys=True))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(buffer.getvalue())
    os.replace(tmp, path)


def load(path: str, source: Dict, sizes: Mapping[str, int]
         ) -> Optional[Dict[str, Dict[str, np.ndarray]]]:
    """The saved log-probs {split: {"ref_chosen", "ref_rejected"}} when `path` holds them
    for this `source` and these split sizes ({split: pairs}); else None."""
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path) as f:
            if str(f["source"]) != json.dumps(source, sort_keys=True):
                return None
            out = {split: {key: np.asarray(f[f"{split}/{key}"]) for key in REF_KEYS}
                   for split in sizes}
    except (OSError, KeyError, ValueError):
        return None
    if any(len(out[split][key]) != n for split, n in sizes.items() for key in REF_KEYS):
        return None
    return out
