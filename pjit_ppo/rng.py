"""Random streams: one key per (seed, purpose, iteration), so no two uses share bits.

Every random choice of a run draws from `stream_key(seed, purpose, iteration)`:
the prompts, the sampler and the update shuffles each have their own stream, and a
resumed run recomputes exactly the keys the uninterrupted run used.
"""
import zlib

import jax

#: The purposes a run draws randomness for. A purpose's stream depends only on its
#: name (through a CRC), so adding a purpose never changes the others.
PURPOSES = ("prompts", "sample", "update", "eval_prompts", "eval_sample", "lora_init",
            "lora_dropout")


def purpose_id(purpose: str) -> int:
    """A stable 31-bit id of a purpose name."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown random purpose {purpose!r}; known: {PURPOSES}")
    return zlib.crc32(purpose.encode()) & 0x7FFFFFFF


def stream_key(seed: int, purpose: str, iteration: int) -> jax.Array:
    """The PRNG key of `purpose` at `iteration`: fold_in(fold_in(key(seed), id), iteration)."""
    base = jax.random.fold_in(jax.random.PRNGKey(seed), purpose_id(purpose))
    return jax.random.fold_in(base, iteration)
