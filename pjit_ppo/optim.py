"""Optimizers: TF-style Adam and the PPO optimizer chain with a per-update LR anneal."""

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax


class TfAdamState(NamedTuple):
    """State of :func:`scale_by_tf_adam`.

    count: int32 scalar, number of steps taken.
    mu, nu: first/second moments, same pytree structure, shapes and dtypes as
      the params (so they can take the params' shardings).
    """

    count: jax.Array
    mu: Any
    nu: Any


def scale_by_tf_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-5
) -> optax.GradientTransformation:
    """Adam with TensorFlow's epsilon placement.

    update_t = sqrt(1 - b2^t) / (1 - b1^t) * m_t / (sqrt(v_t) + eps), where
    m_t, v_t are the *uncorrected* moments. optax.scale_by_adam instead computes
    m_hat / (sqrt(v_hat) + eps), i.e. eps is effectively sqrt(1 - b2^t) times
    smaller early on, which makes the first updates much larger for tiny grads.

    Like optax.scale_by_adam, the result points along the gradient (positive
    direction); chain with a (negative) learning-rate scaling.

    Returns:
      optax.GradientTransformation with state :class:`TfAdamState`.
    """

    def init_fn(params):
        mu = jax.tree.map(jnp.zeros_like, params)
        nu = jax.tree.map(jnp.zeros_like, params)
        return TfAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def update_fn(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * jnp.square(g), state.nu, updates)
        count = optax.safe_int32_increment(state.count)
        t = count.astype(jnp.float32)
        # Bias corrections folded into one float32 step-size factor.
        factor = jnp.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        new_updates = jax.tree.map(
            lambda m, v: (factor * m / (jnp.sqrt(v) + eps)).astype(m.dtype), mu, nu
        )
        return new_updates, TfAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def make_lr_schedule(
    *, learning_rate: float, num_updates: Union[int, jax.Array], anneal_lr: bool = True,
    steps_per_update: int = 1
) -> Callable[[jax.Array], jax.Array]:
    """LR as a function of the optimizer step count.

    lr(s) = learning_rate * (1 - (s // steps_per_update) / num_updates), floored
    at 0, i.e. a linear anneal over PPO updates that is constant within an update
    (one update = ``steps_per_update`` optimizer steps). The last update
    (index num_updates - 1) uses learning_rate / num_updates; it is 0 from step
    num_updates * steps_per_update on. Without ``anneal_lr`` it is constant.

    num_updates may be an int or a (traced) int scalar array: a schedule built inside
    a jitted function from an argument makes the run length an input of the compiled
    program instead of a constant in it, so runs that differ only in their length
    share one program (the same float32 arithmetic either way: a multiplication by the
    float32 reciprocal of num_updates).

    Returns:
      schedule: int scalar count -> float32 scalar lr (jittable).
    """
    if steps_per_update <= 0 or (not isinstance(num_updates, jax.Array) and num_updates <= 0):
        raise ValueError("num_updates and steps_per_update must be positive")

    def schedule(count):
        if not anneal_lr:
            return jnp.asarray(learning_rate, jnp.float32)
        update = (jnp.asarray(count, jnp.int32) // steps_per_update).astype(jnp.float32)
        # update * (1 / n), not update / n: XLA rewrites a division by a constant into
        # this product, so a run length given as a runtime input computes the same
        # float32 numbers as one compiled in as a constant.
        frac = jnp.maximum(1.0 - update * (1.0 / jnp.asarray(num_updates, jnp.float32)), 0.0)
        return jnp.asarray(learning_rate, jnp.float32) * frac

    return schedule


def make_optimizer(
    *,
    learning_rate: float,
    num_updates: Union[int, jax.Array],
    anneal_lr: bool = True,
    kind: str = "tf_adam",
    eps: float = 1e-5,
    b1: float = 0.9,
    b2: float = 0.999,
    max_grad_norm: Optional[float] = None,
    steps_per_update: int = 1,
) -> optax.GradientTransformation:
    """The PPO optimizer: [clip by global norm] -> Adam -> -lr(step).

    Args:
      learning_rate: peak LR.
      num_updates: number of PPO updates (rollout + optimisation rounds) of the run; an
        int, or a traced int scalar to make it an input of a compiled program.
      anneal_lr: anneal linearly to 0 over updates (see :func:`make_lr_schedule`).
      kind: "tf_adam" (eps on the uncorrected second moment, the reference's)
        or "adam" (optax/PyTorch placement).
      eps, b1, b2: Adam constants.
      max_grad_norm: clip gradients to this global norm when set.
      steps_per_update: optimizer steps per PPO update (noptepochs * nminibatches).

    Returns:
      optax transformation whose state is an ``optax.InjectHyperparamsState``;
      ``state.hyperparams["learning_rate"]`` (float32 scalar) holds the LR used by
      the most recent step (LR of step 0 right after init); see
      :func:`current_lr`.
    """
    if kind not in ("tf_adam", "adam"):
        raise ValueError(f"optimizer kind must be 'tf_adam' or 'adam', got {kind!r}")
    schedule = make_lr_schedule(
        learning_rate=learning_rate,
        num_updates=num_updates,
        anneal_lr=anneal_lr,
        steps_per_update=steps_per_update,
    )

    def chain(learning_rate):
        parts = []
        if max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(max_grad_norm))
        if kind == "tf_adam":
            parts.append(scale_by_tf_adam(b1=b1, b2=b2, eps=eps))
        else:
            parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
        parts.append(optax.scale_by_learning_rate(learning_rate, flip_sign=True))
        return optax.chain(*parts)

    # float32 hyperparams even with bf16 params, so the annealed LR is not rounded.
    return optax.inject_hyperparams(chain, hyperparam_dtype=jnp.float32)(learning_rate=schedule)


def current_lr(opt_state) -> jax.Array:
    """float32 scalar LR of the last step of a :func:`make_optimizer` state."""
    return opt_state.hyperparams["learning_rate"]
