"""KL-penalty coefficient controllers as pure functions over a scalar state.

The state is just the float32 scalar ``kl_coef``, so it can be carried through
jitted train steps and saved in checkpoints like any other array.
"""

import dataclasses

import jax
import jax.numpy as jnp

_KINDS = ("adaptive", "fixed")


@dataclasses.dataclass(frozen=True)
class KLControllerConfig:
    """Static KL controller settings.

    kind: "adaptive" (Ziegler et al. 2019) or "fixed".
    init_kl_coef: initial coefficient beta.
    target: target KL (nats per episode, summed over response tokens); adaptive only.
    horizon: adaptation horizon in episodes; adaptive only.
    """

    kind: str = "adaptive"
    init_kl_coef: float = 0.15
    target: float = 6.0
    horizon: float = 10000

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"KL controller kind must be one of {_KINDS}, got {self.kind!r}")
        if self.kind == "adaptive" and (self.target <= 0 or self.horizon <= 0):
            raise ValueError("adaptive KL controller needs target > 0 and horizon > 0")


def kl_init(cfg: KLControllerConfig) -> jax.Array:
    """Initial controller state: float32 scalar ``cfg.init_kl_coef``."""
    return jnp.asarray(cfg.init_kl_coef, jnp.float32)


def kl_update(
    cfg: KLControllerConfig, kl_coef: jax.Array, current_kl: jax.Array, n_steps
) -> jax.Array:
    """One controller step.

    Adaptive: error = clip(current_kl / target - 1, -0.2, 0.2);
    kl_coef * (1 + error * n_steps / horizon). Fixed: kl_coef unchanged.

    Args:
      cfg: static config.
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
    if cfg.kind == "fixed":
        return kl_coef
    error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / cfg.target - 1.0, -0.2, 0.2)
    mult = 1.0 + error * jnp.asarray(n_steps, jnp.float32) / cfg.horizon
    return kl_coef * mult
