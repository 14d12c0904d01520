"""PPOTrainer: sharded state, the two compiled phases, and the iteration loop.

Per iteration: `rollout` (one jitted program) -> `update` (one jitted program, train
state donated) -> metrics to the writers. The only host transfers are the prompts
going in and the scalar metrics coming out.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from pjit_ppo import flops as flops_lib
from pjit_ppo import sharding
from pjit_ppo.optim import make_optimizer
from pjit_ppo.ppo.config import PPOConfig
from pjit_ppo.ppo.kl import kl_init
from pjit_ppo.ppo.rollout import PPOModels, RolloutBatch, rollout
from pjit_ppo.ppo.update import TrainState, kl_config, update

# (iteration) -> (query int32 [B, Q] global array, query_mask bool [B, Q])
PromptFn = Callable[[int], Tuple[jax.Array, jax.Array]]


def make_ppo_optimizer(cfg: PPOConfig) -> optax.GradientTransformation:
    """The optimizer the reference recipe uses, from the PPO config."""
    return make_optimizer(learning_rate=cfg.lr, num_updates=cfg.num_updates,
                          anneal_lr=cfg.anneal_lr, kind=cfg.optimizer, eps=cfg.eps,
                          max_grad_norm=cfg.max_grad_norm,
                          steps_per_update=cfg.noptepochs * cfg.nminibatches)


def iteration_keys(cfg: PPOConfig, iteration: int) -> Tuple[jax.Array, jax.Array]:
    """(sampling key, update key) of one iteration: fresh per iteration, same after resume."""
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), iteration)
    sample_key, update_key = jax.random.split(key)
    return sample_key, update_key


def _forward_flops(model, tokens_per_row: int, context: int, head_tokens: int,
                   last_layer_tokens: Optional[int] = None) -> float:
    """Forward FLOPs of one row: trunk over tokens_per_row at `context`, head on head_tokens.

    last_layer_tokens: how many positions the last layer computes in full (scoring
    passes use `output_slice`); the other positions only need its key and value
    projections. None = all of them.
    """
    c = model
    per_layer = flops_lib.transformer_flops_per_token(
        1, c.d_model, c.n_heads, c.head_dim, c.d_ff, c.vocab_size, context,
        gated_mlp=c.gated_mlp, n_kv_heads=c.n_kv_heads, lm_head=False)
    trunk = c.n_layers * per_layer * tokens_per_row
    if last_layer_tokens is not None:
        kv_only = flops_lib.kv_projection_flops_per_token(c.d_model, c.head_dim, c.n_kv_heads)
        trunk -= (per_layer - kv_only) * (tokens_per_row - last_layer_tokens)
    return trunk + 2.0 * c.d_model * c.vocab_size * head_tokens


def phase_flops(cfg: PPOConfig, models: PPOModels, reward_model=None) -> Dict[str, float]:
    """Model FLOPs of one iteration: {"rollout": ..., "update": ...} (global batch).

    Counts matmul and attention FLOPs (2 per multiply-add) of the work done: the
    scoring passes' last layer only at the positions they read (R for logprobs and
    values, R + 1 for the reward). The backward pass is counted as twice the
    forward; recomputation from remat is not counted (MFU counts useful work only).
    """
    b, q, r = cfg.batch_size, cfg.query_length, cfg.response_length
    pol = models.policy
    sample = _forward_flops(pol, q, q, 1) + _forward_flops(pol, r, q + r // 2, r)
    policy_fwd = _forward_flops(pol, q + r, q + r, r, last_layer_tokens=r)
    critic_fwd = (0.0 if cfg.shared_trunk else
                  _forward_flops(models.critic, q + r, q + r, 0, last_layer_tokens=r))
    reward_fwd = (_forward_flops(reward_model, q + r, q + r, 0, last_layer_tokens=r + 1)
                  if reward_model else 0.0)
    rollout_f = sample + 2 * policy_fwd + critic_fwd + reward_fwd
    if not cfg.recompute_rollout_logprobs and not cfg.shared_trunk:
        rollout_f -= policy_fwd
    update_f = 3.0 * cfg.noptepochs * (policy_fwd + critic_fwd)
    return {"rollout": b * rollout_f, "update": b * update_f}


class PPOTrainer:
    """Runs PPO iterations on a mesh.

    Args:
      cfg: PPOConfig.
      models: PPOModels (static architectures + reward function).
      mesh: the device mesh; params passed in must already be sharded on it.
      optimizer: defaults to `make_ppo_optimizer(cfg)`.
      reward_model: the reward model's ModelConfig, only for FLOP accounting.
      peak_flops: device peak FLOP/s (global) for MFU; None leaves MFU out.
    """

    def __init__(self, cfg: PPOConfig, models: PPOModels, mesh: Mesh,
                 optimizer: Optional[optax.GradientTransformation] = None,
                 reward_model=None, peak_flops: Optional[float] = None):
        if cfg.shared_trunk != (models.critic is None):
            raise ValueError("shared_trunk=True needs models.critic=None and vice versa")
        self.cfg, self.models, self.mesh = cfg, models, mesh
        self.optimizer = optimizer or make_ppo_optimizer(cfg)
        self.flops = phase_flops(cfg, models, reward_model)
        self.peak_flops = peak_flops
        self._rollout = None
        self._update = None

    # ------------------------------------------------------------ state
    def init_state(self, params) -> TrainState:
        """TrainState from sharded trainable params; optimizer state sharded like them."""
        param_sh = jax.tree_util.tree_map(lambda x: x.sharding, params)
        opt_shapes = jax.eval_shape(self.optimizer.init, params)
        opt_sh = sharding.opt_state_shardings(self.optimizer, param_sh, opt_shapes, self.mesh)
        opt_state = jax.jit(self.optimizer.init, out_shardings=opt_sh)(params)
        rep = sharding.replicated(self.mesh)
        return TrainState(params, opt_state,
                          jax.device_put(kl_init(kl_config(self.cfg)), rep),
                          jax.device_put(jnp.zeros((), jnp.int32), rep))

    # ------------------------------------------------------------ compiled phases
    def _compile(self, state: TrainState):
        mesh, cfg = self.mesh, self.cfg
        rep = sharding.replicated(mesh)
        batch_sh = RolloutBatch(*[sharding.batch_sharding(mesh, 2)] * len(RolloutBatch._fields))
        state_sh = jax.tree_util.tree_map(lambda x: x.sharding, state)

        def constrain_batch(mb):
            return jax.tree_util.tree_map(
                lambda x: jax.lax.with_sharding_constraint(x, sharding.batch_sharding(mesh, 2)),
                mb)

        self._rollout = jax.jit(
            functools.partial(rollout, cfg, self.models, mesh=mesh),
            out_shardings=(batch_sh, rep))
        self._update = jax.jit(
            functools.partial(update, cfg, self.models, self.optimizer,
                              batch_constraint=constrain_batch),
            donate_argnums=(0,), out_shardings=(state_sh, rep))

    def rollout(self, state: TrainState, frozen, query, query_mask, iteration: int):
        """The rollout phase alone (jitted): (RolloutBatch, metrics on device)."""
        if self._rollout is None:
            self._compile(state)
        sample_key, _ = iteration_keys(self.cfg, iteration)
        return self._rollout(state.params, frozen, state.kl_coef, query, query_mask, sample_key)

    def step(self, state: TrainState, frozen, query: jax.Array, query_mask: jax.Array,
             iteration: int) -> Tuple[TrainState, Dict[str, float]]:
        """One PPO iteration. `state` is donated; returns the new state and host metrics."""
        if self._rollout is None:
            self._compile(state)
        _, update_key = iteration_keys(self.cfg, iteration)
        t0 = time.perf_counter()
        batch, rollout_metrics = self.rollout(state, frozen, query, query_mask, iteration)
        jax.block_until_ready(batch)
        t1 = time.perf_counter()
        state, update_metrics = self._update(state, batch, rollout_metrics["objective/kl"],
                                             update_key)
        jax.block_until_ready(state.params)
        t2 = time.perf_counter()
        metrics = {k: float(v) for k, v in jax.device_get({**rollout_metrics,
                                                           **update_metrics}).items()}
        metrics.update(self._throughput(t1 - t0, t2 - t1))
        metrics["ppo/episode"] = float((iteration + 1) * self.cfg.batch_size)
        return state, metrics

    def _throughput(self, rollout_s: float, update_s: float) -> Dict[str, float]:
        cfg = self.cfg
        tokens = cfg.batch_size * (cfg.query_length + cfg.response_length)
        out = {"time/rollout_s": rollout_s, "time/update_s": update_s,
               "time/iteration_s": rollout_s + update_s}
        for phase, secs in (("rollout", rollout_s), ("update", update_s)):
            out[f"throughput/{phase}_episodes_per_s"] = cfg.batch_size / secs
            out[f"throughput/{phase}_tokens_per_s"] = tokens / secs
            out[f"throughput/{phase}_tflops"] = self.flops[phase] / secs / 1e12
            if self.peak_flops:
                out[f"throughput/{phase}_mfu"] = self.flops[phase] / secs / self.peak_flops
        out["throughput/episodes_per_s"] = cfg.batch_size / (rollout_s + update_s)
        return out

    def train(self, state: TrainState, frozen, prompts: PromptFn, num_iterations: int,
              writer=None, start_iteration: int = 0,
              on_iteration: Optional[Callable[[int, TrainState, Dict[str, float]], None]] = None
              ) -> TrainState:
        """Runs iterations start_iteration .. num_iterations - 1; returns the final state."""
        for it in range(start_iteration, num_iterations):
            query, query_mask = prompts(it)
            state, metrics = self.step(state, frozen, query, query_mask, it)
            if writer is not None:
                writer.write(it + 1, metrics)  # iterations completed
            if on_iteration is not None:
                on_iteration(it, state, metrics)
            if not all(map(_finite, metrics.values())):
                bad = sorted(k for k, v in metrics.items() if not _finite(v))
                raise FloatingPointError(
                    f"non-finite metrics at iteration {it}: {bad}; lower ppo.lr, enable "
                    f"ppo.max_grad_norm, or check the reward function")
        return state


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
