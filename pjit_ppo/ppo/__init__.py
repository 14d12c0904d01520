"""PPO math: advantages, losses and KL controllers (pure, jittable functions)."""
