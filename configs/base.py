"""The shared base of the recipes in configs/: model shapes, the lm-human-preferences
defaults, and the `:ARG` variants every recipe understands.

A recipe loads this file by path (recipes are loaded by path, not as a package):

    import os, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import base  # noqa: E402  (configs/base.py)

and builds its config with `base.recipe(...)`. Every field the recipes set is a
`pjit_ppo.config` field, documented there; what a recipe decides (which model, which
reward, which prompts) is documented in the recipe.

Variants: `--config=configs/NAME.py:ARG` where ARG is a comma-separated list of
  random    no downloads: policy and reward randomly initialised from the recipe's HF
            config dict (model.random), random token prompts. For planning, smoke runs
            and tests; nothing learns anything meaningful.
  fsdp      mesh data=1, fsdp=-1 (all devices), tensor=1: the default.
  dp        mesh data=-1, fsdp=1: parameters replicated (small models only).
  tpN       mesh tensor=N, fsdp=-1 (e.g. tp2, tp8): heads / mlp / vocab split N ways.
and the names in the recipe's own VARIANTS (e.g. a smaller batch).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, Mapping, Optional

from pjit_ppo.config import (CheckpointOptions, DataOptions, MeshConfig, ModelOptions,
                             PPOConfig, RewardOptions, RunConfig)

# ------------------------------------------------------------------ model shapes
# HF config.json dicts (the fields our model families read), so planning and random-init
# runs need no download. A real run reads the same from model.policy_path/config.json.

#: GPT-2 124M ("gpt2" on the HF hub): 12 layers, d_model 768, 12 heads, vocab 50257.
GPT2_124M: Dict[str, Any] = dict(
    model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=50257, n_positions=1024,
    n_ctx=1024, n_embd=768, n_layer=12, n_head=12, activation_function="gelu_new",
    layer_norm_epsilon=1e-5, bos_token_id=50256, eos_token_id=50256)

#: Pythia-1B ("EleutherAI/pythia-1b"): GPT-NeoX, 16 layers, d_model 2048, 8 heads,
#: rotary on 25% of each head, parallel residual, embedding padded to 50304 rows.
PYTHIA_1B: Dict[str, Any] = dict(
    model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], vocab_size=50304,
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192,
    hidden_act="gelu", max_position_embeddings=2048, rotary_pct=0.25, rotary_emb_base=10000,
    layer_norm_eps=1e-5, use_parallel_residual=True, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=0)

#: Llama-2-7B ("meta-llama/Llama-2-7b-hf"): 32 layers, d_model 4096, 32 heads (no GQA),
#: SwiGLU d_ff 11008, RMSNorm, rotary, context 4096, vocab 32000.
LLAMA2_7B: Dict[str, Any] = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=4096,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    intermediate_size=11008, hidden_act="silu", max_position_embeddings=4096,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2)


# ------------------------------------------------------------------ defaults
def lm_human_preferences_ppo(**changes) -> PPOConfig:
    """PPO at lm-human-preferences' defaults (the PPOConfig defaults, spelt out here so a
    recipe reads as the reference does): 64-token queries, 24-token responses at
    temperature 0.7, truncation after '.' from token 16 on (penalty -1 without one),
    batch 512 in 1 minibatch x 4 epochs, 1M episodes, TF-style Adam lr 1e-5 annealed to 0,
    adaptive KL from 0.15 towards 6 nats over a 10k-episode horizon, GAE gamma 1 / lam 0.95,
    whitened rewards, clip 0.2, value coefficient 0.1. `changes` override any field."""
    fields = dict(query_length=64, response_length=24, temperature=0.7, top_k=0, top_p=1.0,
                  truncate_token=13, truncate_after=16, penalty_reward_value=-1.0,
                  batch_size=512, nminibatches=1, noptepochs=4, gradient_accumulation_steps=1,
                  total_episodes=1_000_000, optimizer="tf_adam", lr=1e-5, eps=1e-5,
                  anneal_lr=True, kl_controller="adaptive", init_kl_coef=0.15, kl_target=6.0,
                  kl_horizon=10000, gamma=1.0, lam=0.95, whiten_rewards=True, cliprange=0.2,
                  cliprange_value=0.2, vf_coef=0.1, critic_init="reward", pad_token_id=50259)
    fields.update(changes)
    return PPOConfig(**fields)


def recipe(*, shape: Mapping[str, Any], policy_path: str, reward_path: str,
           ppo: PPOConfig, data: DataOptions, compute_dtype: str = "float32",
           remat_policy: str = "none", mesh: Optional[MeshConfig] = None,
           arg: str = "", variants: Optional[Mapping[str, Callable[[RunConfig], None]]] = None,
           ) -> RunConfig:
    """A recipe's RunConfig: the policy at `policy_path` (shape `shape` for random init and
    planning), a reward model at `reward_path` (the critic starts from its trunk), then the
    variants named in `arg` applied in order.

    Raises ValueError naming the unknown variant and the known ones.
    """
    config = RunConfig(
        ppo=ppo, mesh=mesh or MeshConfig(data=1, fsdp=-1, tensor=1),
        model=ModelOptions(policy_path=policy_path, compute_dtype=compute_dtype,
                           remat_policy=remat_policy, random=dict(shape)),
        reward=RewardOptions(kind="model", path=reward_path),
        data=data, checkpoint=CheckpointOptions(every=20, keep=3))
    apply_variants(config, arg, variants or {})
    return config


# ------------------------------------------------------------------ variants
def use_random_models(config: RunConfig) -> None:
    """No downloads: random policy and reward from model.random, random token prompts."""
    config.model.policy_path = ""
    config.reward.path = ""
    config.data = dataclasses.replace(config.data, prompts_path="", tokenizer_path="")


def _mesh(data: int, fsdp: int, tensor: int) -> Callable[[RunConfig], None]:
    def apply(config: RunConfig) -> None:
        config.mesh = MeshConfig(data=data, fsdp=fsdp, tensor=tensor)
    return apply


def use_lora(rank: int = 16, alpha: float = 32.0) -> Callable[[RunConfig], None]:
    """LoRA adapters of `rank` on every attention and MLP projection of the policy and
    (ppo.critic_lora, the default) of the critic: the base weights stay frozen in the
    compute dtype and serve as the reference too; only adapters have gradients and Adam
    moments."""
    def apply(config: RunConfig) -> None:
        config.model.lora.rank, config.model.lora.alpha = rank, alpha
    return apply


COMMON_VARIANTS: Dict[str, Callable[[RunConfig], None]] = {
    "random": use_random_models,
    "fsdp": _mesh(1, -1, 1),
    "dp": _mesh(-1, 1, 1),
}


def apply_variants(config: RunConfig, arg: str,
                   variants: Mapping[str, Callable[[RunConfig], None]]) -> RunConfig:
    """Applies the comma-separated variant names of `arg` (COMMON_VARIANTS, tpN, or the
    recipe's own `variants`) to `config` in order."""
    known = {**COMMON_VARIANTS, **variants}
    for name in filter(None, (part.strip() for part in arg.split(","))):
        tensor = re.fullmatch(r"tp(\d+)", name)
        if tensor and int(tensor.group(1)) >= 1:
            _mesh(1, -1, int(tensor.group(1)))(config)
        elif name in known:
            known[name](config)
        else:
            raise ValueError(f"unknown recipe variant {name!r}; choose from "
                             f"{', '.join(sorted(known))} or tpN (e.g. tp2), comma-separated")
    return config
