"""KL-penalty coefficient controllers as pure functions over a scalar state.

The state is just the float32 scalar ``kl_coef``, so it is carried through the
jitted update and saved with the train state like any other array. The settings
are the PPOConfig fields `kl_controller`, `init_kl_coef`, `kl_target`, `kl_horizon`.
"""
import jax
import jax.numpy as jnp

from pjit_ppo.config import PPOConfig


def kl_init(cfg: PPOConfig) -> jax.Array:
    """Initial controller state: float32 scalar ``cfg.init_kl_coef``."""
    return jnp.asarray(cfg.init_kl_coef, jnp.float32)


def kl_update(cfg: PPOConfig, kl_coef: jax.Array, current_kl: jax.Array, n_steps) -> jax.Array:
    """One controller step.

    "adaptive" (Ziegler et al. 2019): error = clip(current_kl / kl_target - 1, -0.2, 0.2);
    kl_coef * (1 + error * n_steps / kl_horizon). "fixed": kl_coef unchanged.

    Args:
      cfg: PPOConfig (kl_controller, kl_target, kl_horizon).
      kl_coef: float32 scalar, current coefficient.
      current_kl: float scalar, the *global* batch mean of the per-episode KL
        (sum over response tokens of logp - ref_logp, averaged over every episode
        of the global batch, across all devices/processes). Passing a per-device
        value would make controllers drift apart between devices.
      n_steps: int/float scalar, episodes consumed since the last update (the
        global batch size).

    Returns:
      float32 scalar, the new coefficient.
    """
    kl_coef = jnp.asarray(kl_coef, jnp.float32)
    if cfg.kl_controller == "fixed":
        return kl_coef
    if cfg.kl_controller != "adaptive":
        raise ValueError(f"ppo.kl_controller={cfg.kl_controller!r}; choose 'adaptive' or 'fixed'")
    error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / cfg.kl_target - 1.0, -0.2, 0.2)
    mult = 1.0 + error * jnp.asarray(n_steps, jnp.float32) / cfg.kl_horizon
    return kl_coef * mult
