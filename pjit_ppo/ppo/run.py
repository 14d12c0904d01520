"""From an ml_collections config to a running PPO job (what launch/train_ppo.py calls)."""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Dict

import jax
import ml_collections

from pjit_ppo import data, flops, metrics as metrics_lib, sharding
from pjit_ppo.models import ModelConfig, init_params, load_pretrained
from pjit_ppo.models import heads
from pjit_ppo.ppo import setup
from pjit_ppo.ppo.config import PPOConfig
from pjit_ppo.ppo.rollout import PPOModels, model_reward_fn
from pjit_ppo.ppo.synthetic_reward import target_token_reward
from pjit_ppo.ppo.trainer import PPOTrainer

CONSOLE_KEYS = ("objective/scores", "objective/kl", "objective/kl_coef", "ppo/loss/total",
                "time/rollout_s", "time/update_s")


def _load_lm(model_cfg: ml_collections.ConfigDict, path: str, mesh, seed: int):
    """(ModelConfig, fp32 params sharded on mesh) from an HF dir, or random from model.random."""
    overrides = dict(compute_dtype=model_cfg.compute_dtype, remat_policy=model_cfg.remat_policy,
                     scan_unroll=model_cfg.scan_unroll)
    if path:
        return load_pretrained(path, mesh=mesh, dtype="float32", config_overrides=overrides)
    config = ModelConfig.from_hf_dict(dict(model_cfg.random), **overrides)
    params = sharding.init_sharded(functools.partial(init_params, config), mesh,
                                   jax.random.PRNGKey(seed))
    return config, params


def build(config: ml_collections.ConfigDict):
    """Builds (trainer, state, frozen, prompt_fn, num_iterations) from a run config."""
    ppo_cfg = PPOConfig(**config.ppo.to_dict())
    mesh = sharding.make_mesh(**config.mesh.to_dict())
    policy_cfg, policy = _load_lm(config.model, config.model.policy_path, mesh, ppo_cfg.seed)
    frozen: Dict[str, Any] = {"ref": setup.make_reference(policy, policy_cfg.compute_dtype)}

    reward_model_cfg = None
    if config.reward.kind == "model":
        reward_model_cfg, reward_trunk = _load_lm(config.model, config.reward.path, mesh,
                                                  ppo_cfg.seed + 1)
        head = heads.init_reward_head(reward_model_cfg.d_model,
                                      jax.random.PRNGKey(config.reward.head_seed))
        reward = setup.trunk_only(reward_trunk)  # fp32: also the critic's starting point
        reward.update(jax.device_put(head, sharding.replicated(mesh)))
        frozen["reward"] = setup.make_frozen(reward, reward_model_cfg.compute_dtype)
        reward_fn = model_reward_fn(reward_model_cfg)
    elif config.reward.kind == "target_tokens":
        frozen["reward"] = None
        reward_fn = target_token_reward(tuple(config.reward.target_ids))
    else:
        raise ValueError(f"reward.kind={config.reward.kind!r}; choose 'model' or 'target_tokens'")

    if ppo_cfg.shared_trunk:
        params = {"policy": policy,
                  **jax.device_put(heads.init_value_head(policy_cfg.d_model),
                                   sharding.replicated(mesh))}
        critic_cfg = None
    else:
        if ppo_cfg.critic_init == "reward" and config.reward.kind != "model":
            raise ValueError("ppo.critic_init='reward' needs reward.kind='model'; use "
                             "ppo.critic_init='policy' with a synthetic reward")
        source, critic_cfg = ((reward, reward_model_cfg)
                              if ppo_cfg.critic_init == "reward" else (policy, policy_cfg))
        critic = setup.make_critic(source, critic_cfg.d_model, mesh)
        params = {"policy": policy, "critic": critic}

    models = PPOModels(policy=policy_cfg, critic=critic_cfg, reward_fn=reward_fn)
    peak = flops.measure_matmul_peak_flops() * jax.device_count() if config.measure_peak else None
    trainer = PPOTrainer(ppo_cfg, models, mesh, reward_model=reward_model_cfg, peak_flops=peak)
    state = trainer.init_state(params)
    prompts = data.synthetic_prompts(
        mesh, batch_size=ppo_cfg.batch_size, query_length=ppo_cfg.query_length,
        vocab_size=policy_cfg.vocab_size, pad_id=ppo_cfg.pad_token_id, seed=ppo_cfg.seed,
        min_length=config.data.min_prompt_length, low=config.data.low_token)
    num_iterations = config.num_iterations if config.num_iterations > 0 else ppo_cfg.num_updates
    return trainer, state, frozen, prompts, num_iterations


def train(config: ml_collections.ConfigDict, workdir: str) -> Dict[str, float]:
    """Runs a PPO job; metrics go to WORKDIR/metrics.jsonl, TensorBoard and the console.

    Returns the last iteration's metrics.
    """
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2, default=str)
    trainer, state, frozen, prompts, num_iterations = build(config)
    writer = metrics_lib.make_writers(workdir, num_iterations, console_keys=CONSOLE_KEYS,
                                      tensorboard=config.tensorboard)
    last: Dict[str, float] = {}

    def remember(it, state, m):
        last.update(m)

    try:
        trainer.train(state, frozen, prompts, num_iterations, writer=writer,
                      on_iteration=remember)
    finally:
        writer.close()
    return last
