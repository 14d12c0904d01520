"""pjit_ppo: PPO from human preferences for large language models with Haiku + pjit."""
__version__ = "0.1.0"
