"""Pieces shared by the recipe configs: the PPO section with reference defaults."""
import dataclasses

import ml_collections

from pjit_ppo.ppo.config import PPOConfig


def ppo_defaults(**overrides) -> ml_collections.ConfigDict:
    """A ConfigDict with every PPOConfig field (types fixed by the defaults)."""
    fields = {f.name: getattr(PPOConfig, f.name) for f in dataclasses.fields(PPOConfig)}
    fields.update(overrides)
    # Optional fields (None) get a typed placeholder so --config.ppo.x=v overrides work.
    for name, kind in _OPTIONAL.items():
        if fields[name] is None:
            fields[name] = ml_collections.config_dict.placeholder(kind)
    return ml_collections.ConfigDict(fields)


_OPTIONAL = {"truncate_token": int, "max_grad_norm": float}


def base_config() -> ml_collections.ConfigDict:
    """Everything but the model sizes and the PPO hyperparameters."""
    c = ml_collections.ConfigDict()
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.model = ml_collections.ConfigDict(dict(
        policy_path="",              # HF directory; "" = random init from model.random
        compute_dtype="float32",     # activations/matmuls; bf16 on accelerators
        remat_policy="none",         # "none", "full", or a jax.checkpoint_policies name
        scan_unroll=1,               # layers per scan step (n_layers = unrolled)
        random=ml_collections.ConfigDict()))
    c.reward = ml_collections.ConfigDict(dict(
        kind="target_tokens",        # "model" (reward model) or "target_tokens" (demo)
        path="",                     # HF directory of the reward trunk ("" = model.random)
        head_seed=0,                 # reward head init N(0, 1/sqrt(d+1)) until trained
        target_ids=(5, 6, 7)))       # for kind="target_tokens"
    c.data = ml_collections.ConfigDict(dict(min_prompt_length=1, low_token=0))
    c.num_iterations = -1            # -1: ppo.total_episodes // ppo.batch_size
    c.tensorboard = True
    c.measure_peak = True            # measure a matmul peak for MFU at start-up
    return c
