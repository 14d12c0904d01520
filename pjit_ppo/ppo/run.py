"""From a RunConfig to a running PPO job (what the train entry point calls)."""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Dict, NamedTuple, Optional

import jax

from pjit_ppo import data, flops, metrics as metrics_lib, sharding
from pjit_ppo.config import ModelOptions, RunConfig
from pjit_ppo.models import ModelConfig, heads, init_params, load_pretrained
from pjit_ppo.ppo import assemble
from pjit_ppo.ppo.rewards import model_reward_fn, target_token_reward
from pjit_ppo.ppo.trainer import PPOTrainer
from pjit_ppo.ppo.types import PPOModels, PromptFn, TrainState


def load_lm(options: ModelOptions, path: str, mesh, seed: int):
    """(ModelConfig, fp32 params sharded on mesh) from an HF dir, or random from options.random."""
    overrides = options.overrides()
    if path:
        return load_pretrained(path, mesh=mesh, dtype="float32", config_overrides=overrides)
    config = ModelConfig.from_hf_dict(dict(options.random), **overrides)
    params = sharding.init_sharded(functools.partial(init_params, config), mesh,
                                   jax.random.PRNGKey(seed))
    return config, params


class Job(NamedTuple):
    """Everything a PPO run needs, built from a RunConfig."""
    trainer: PPOTrainer
    state: TrainState
    frozen: Dict[str, Any]
    prompts: PromptFn
    num_iterations: int


def build(config: RunConfig) -> Job:
    """Validates `config` and builds the mesh, the four models, the trainer and the prompts."""
    config.validate()
    ppo_cfg = config.ppo
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    policy_cfg, policy = load_lm(config.model, config.model.policy_path, mesh, ppo_cfg.seed)
    frozen: Dict[str, Any] = {"ref": assemble.make_frozen(policy, policy_cfg.compute_dtype)}

    reward_model_cfg: Optional[ModelConfig] = None
    if config.reward.kind == "model":
        reward_model_cfg, reward_trunk = load_lm(config.model, config.reward.path, mesh,
                                                 ppo_cfg.seed + 1)
        head = heads.init_reward_head(reward_model_cfg.d_model,
                                      jax.random.PRNGKey(config.reward.head_seed))
        reward = assemble.trunk_only(reward_trunk)  # fp32: also the critic's starting point
        reward.update(jax.device_put(head, sharding.replicated(mesh)))
        frozen["reward"] = assemble.make_frozen(reward, reward_model_cfg.compute_dtype)
        reward_fn = model_reward_fn(reward_model_cfg)
    else:
        frozen["reward"] = None
        reward_fn = target_token_reward(tuple(config.reward.target_ids))

    if ppo_cfg.shared_trunk:
        params = {"policy": policy,
                  **jax.device_put(heads.init_value_head(policy_cfg.d_model),
                                   sharding.replicated(mesh))}
        critic_cfg = None
    else:
        source, critic_cfg = ((reward, reward_model_cfg)
                              if ppo_cfg.critic_init == "reward" else (policy, policy_cfg))
        params = {"policy": policy,
                  "critic": assemble.make_critic(source, critic_cfg.d_model, mesh)}

    models = PPOModels(policy=policy_cfg, critic=critic_cfg, reward_fn=reward_fn)
    peak = flops.measure_matmul_peak_flops() * jax.device_count() if config.measure_peak else None
    trainer = PPOTrainer(ppo_cfg, models, mesh, num_updates=config.num_updates,
                         reward_model=reward_model_cfg, peak_flops=peak)
    state = trainer.init_state(params)
    prompts = data.synthetic_prompts(
        mesh, batch_size=ppo_cfg.batch_size, query_length=ppo_cfg.query_length,
        vocab_size=policy_cfg.vocab_size, pad_id=ppo_cfg.pad_token_id, seed=ppo_cfg.seed,
        min_length=config.data.min_prompt_length, low=config.data.low_token)
    return Job(trainer, state, frozen, prompts, config.num_updates)


def write_config(config: RunConfig, workdir: str) -> str:
    """Writes WORKDIR/config.json atomically (a temp file renamed over it); returns the path."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "config.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(config.to_dict(), f, indent=2, default=str)
    os.replace(tmp, path)
    return path


def train(config: RunConfig, workdir: str) -> Dict[str, float]:
    """Runs a PPO job; metrics go to WORKDIR/metrics.jsonl, TensorBoard and the console.

    Returns the last iteration's metrics.
    """
    config.validate()
    write_config(config, workdir)
    job = build(config)
    writer = metrics_lib.make_writers(workdir, job.num_iterations,
                                      tensorboard=config.tensorboard)
    last: Dict[str, float] = {}

    def remember(it, state, m):
        last.update(m)

    try:
        job.trainer.train(job.state, job.frozen, job.prompts, job.num_iterations,
                          writer=writer, on_iteration=remember)
    finally:
        writer.close()
    return last
