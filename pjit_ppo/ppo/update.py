"""The PPO update: epochs x minibatches x micro-batches, as one traceable function.

`update` is jitted by the trainer with the train state donated: a `lax.scan`
over epochs (fresh permutation each, derived from the iteration's key), a
`lax.scan` over minibatches (one optimizer step each), and a `lax.scan` over
micro-batches that accumulates gradients. Metrics are averaged over every
micro-batch of every minibatch of every epoch, i.e. over the whole batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from pjit_ppo import rng
from pjit_ppo.config import PPOConfig
from pjit_ppo.optim import current_lr
from pjit_ppo.ppo import estimators, lora_views
from pjit_ppo.ppo.kl import kl_update
from pjit_ppo.ppo.types import PPOModels, RolloutBatch, TrainState


def epoch_permutations(cfg: PPOConfig, key: jax.Array) -> jax.Array:
    """The shuffles of one update: int32 [noptepochs, batch_size], a fresh one per epoch.

    `key` is the iteration's update key, so every iteration shuffles differently
    (the reference JAX port re-created this key from the seed and repeated them).
    """
    keys = jax.random.split(key, cfg.noptepochs)
    return jax.vmap(lambda k: jax.random.permutation(k, cfg.batch_size))(keys)


def update(cfg: PPOConfig, models: PPOModels, optimizer: optax.GradientTransformation,
           state: TrainState, batch: RolloutBatch, rollout_kl: jax.Array, key: jax.Array,
           batch_constraint=None, frozen=None):
    """noptepochs x nminibatches optimizer steps on one rollout batch.

    Args:
      state: TrainState (donated by the trainer's jit).
      batch: RolloutBatch with global batch size cfg.batch_size (fields the estimator
        does not use are None).
      rollout_kl: float32 scalar, batch mean of the summed per-token KL (objective/kl);
        the adaptive KL controller is updated from this global mean.
      key: PRNG key of this iteration's update (epoch keys are split from it).
      batch_constraint: optional function applied to each gathered micro-batch
        (a sharding constraint that keeps it split over the batch axes).
      frozen: with LoRA, the frozen bases the adapters in state.params sit on
        (`lora_views.update_frozen`); None without. With model.lora.dropout > 0 every
        micro-step draws its own dropout key from rng.stream_key(ppo.seed,
        "lora_dropout", iteration).
    Returns:
      (new TrainState, dict of float32 scalar metrics).
    """
    nmb, gas, micro = cfg.nminibatches, cfg.gradient_accumulation_steps, cfg.microbatch_size
    loss_fn = estimators.get(cfg.advantage_estimator).loss
    keyed = lora_views.dropout(models)

    def loss(p, mb, dropout_key=None):
        return loss_fn(cfg, models, lora_views.view(models, p, frozen, dropout_key), mb)
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    stats_shape = jax.eval_shape(lambda: loss(state.params, jax.tree.map(
        lambda x: x[:micro], batch))[1])
    zero_stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape)

    def minibatch_step(carry, xs):  # idx: int32 [gas, micro] (+ a key with dropout)
        params, opt_state = carry
        idx, minibatch_key = xs if keyed else (xs, None)

        def micro_step(acc, ys):
            grads_acc, stats_acc = acc
            micro_idx, i = ys if keyed else (ys, None)
            mb = jax.tree.map(lambda x: jnp.take(x, micro_idx, axis=0), batch)
            if batch_constraint is not None:
                mb = batch_constraint(mb)
            if keyed:
                (_, stats), grads = grad_fn(params, mb, jax.random.fold_in(minibatch_key, i))
            else:
                (_, stats), grads = grad_fn(params, mb)
            return (jax.tree.map(jnp.add, grads_acc, grads),
                    jax.tree.map(jnp.add, stats_acc, stats)), None

        zero_grads = jax.tree.map(jnp.zeros_like, params)
        ys = (idx, jnp.arange(gas)) if keyed else idx
        (grads, stats), _ = jax.lax.scan(micro_step, (zero_grads, zero_stats), ys)
        grads = jax.tree.map(lambda g: g / gas, grads)
        grad_norm = optax.global_norm(grads)  # before any clipping
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), (stats, grad_norm)

    def epoch_step(carry, xs):
        perm, epoch_key = xs if keyed else (xs, None)
        idx = perm.reshape(nmb, gas, micro)
        ys = (idx, jax.random.split(epoch_key, nmb)) if keyed else idx
        carry, stats = jax.lax.scan(minibatch_step, carry, ys)
        return carry, stats

    perms = epoch_permutations(cfg, key)
    if keyed:
        root = rng.stream_key(cfg.seed, "lora_dropout", state.iteration)
        perms = (perms, jax.random.split(root, cfg.noptepochs))
    (params, opt_state), (stats, grad_norms) = jax.lax.scan(
        epoch_step, (state.params, state.opt_state), perms)
    # stats: [epochs, minibatches] of sums over micro-batches of equal size -> whole-batch mean.
    metrics = jax.tree.map(lambda s: jnp.sum(s) / (cfg.noptepochs * nmb * gas), stats)
    metrics["ppo/grad_norm"] = jnp.mean(grad_norms)
    metrics["ppo/lr"] = current_lr(opt_state)
    if "ppo/val/error" in metrics:
        # lm-human-preferences' definition: an update-time metric. NaN (written as null)
        # when every return is equal.
        metrics["ppo/val/var_explained"] = 1.0 - metrics["ppo/val/error"] / jnp.var(batch.returns)
    if estimators.get(cfg.advantage_estimator).kl_in_reward:
        kl_coef = kl_update(cfg, state.kl_coef, rollout_kl, cfg.batch_size)
    else:  # the KL is a loss term with the fixed ppo.kl_loss_coef
        kl_coef = state.kl_coef
    new_state = TrainState(params, opt_state, kl_coef, state.iteration + 1)
    return new_state, metrics
