"""Random token prompts generated on the devices (demo and test data).

Every batch is a pure function of (seed, iteration), so a resumed run sees the
same prompts as an uninterrupted one.
"""
from __future__ import annotations

import functools
from typing import Callable, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pjit_ppo import rng, sharding
from pjit_ppo.padding import right_to_left_padding


def _synthetic_batch(key, batch_size, query_length, low, high, min_length, pad_id):
    k_len, k_tok = jax.random.split(key)
    lengths = jax.random.randint(k_len, (batch_size, 1), min_length, query_length + 1)
    tokens = jax.random.randint(k_tok, (batch_size, query_length), low, high, jnp.int32)
    mask = jnp.arange(query_length)[None, :] < lengths
    return right_to_left_padding(jnp.where(mask, tokens, pad_id), mask, pad_id)


def synthetic_prompts(mesh: Mesh, *, batch_size: int, query_length: int, vocab_size: int,
                      pad_id: int, seed: int = 0, min_length: int = 1, low: int = 0,
                      purpose: str = "prompts") -> Callable[[int], Tuple[jax.Array, jax.Array]]:
    """A PromptFn of random left-padded prompts: iteration -> (int32 [B, Q], bool [B, Q]).

    Token ids are uniform in [low, vocab_size) excluding nothing (pad_id may lie
    outside the vocabulary, as in the reference's dedicated pad token); lengths are
    uniform in [min_length, query_length]. Generated on the devices directly into
    the batch sharding (no host array of the global batch). `purpose` names the
    random stream ("prompts" for training, "eval_prompts" for held-out evaluation).
    """
    if not 1 <= min_length <= query_length:
        raise ValueError(f"min_length={min_length} must be in [1, query_length={query_length}]")
    out = sharding.batch_sharding(mesh, 2)
    make = jax.jit(functools.partial(_synthetic_batch, batch_size=batch_size,
                                     query_length=query_length, low=low, high=vocab_size,
                                     min_length=min_length, pad_id=pad_id),
                   out_shardings=(out, out))

    def prompts(iteration: int):
        return make(rng.stream_key(seed, purpose, iteration))

    return prompts
