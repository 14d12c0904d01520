"""Prompt data as global arrays sharded over the batch axes.

`synthetic_prompts` loads its module (and jax) on first use, so the submodules that read
files only (special_ids, preferences, corpus) import without starting jax.
"""
from pjit_ppo.errors import DataError

__all__ = ["DataError", "synthetic_prompts"]


def __getattr__(name):
    if name == "synthetic_prompts":
        from pjit_ppo.data.synthetic import synthetic_prompts
        globals()[name] = synthetic_prompts
        return synthetic_prompts
    raise AttributeError(f"module 'pjit_ppo.data' has no attribute {name!r}")
