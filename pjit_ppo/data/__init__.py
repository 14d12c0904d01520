"""Prompt data as global arrays sharded over the batch axes."""
from pjit_ppo.data.synthetic import synthetic_prompts

__all__ = ["synthetic_prompts"]
