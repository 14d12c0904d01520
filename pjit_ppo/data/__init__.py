"""Prompt data as global arrays sharded over the batch axes."""
from pjit_ppo.errors import DataError
from pjit_ppo.data.synthetic import synthetic_prompts

__all__ = ["DataError", "synthetic_prompts"]
