"""Random streams: every purpose and iteration gets its own key."""
import jax
import numpy as np
import pytest

from pjit_ppo import rng


def _bits(key):
    return tuple(np.asarray(jax.random.key_data(key)).ravel().tolist())


def test_streams_differ_by_purpose_iteration_and_seed():
    keys = {(s, p, i): _bits(rng.stream_key(s, p, i))
            for s in (0, 1) for p in rng.PURPOSES for i in range(4)}
    assert len(set(keys.values())) == len(keys)  # no two uses share a key


def test_prompt_and_sample_streams_draw_different_numbers():
    # The bug this replaces: prompts and sampling both started from fold_in(key(seed), it)
    # and split it the same way, so the prompt lengths reused the sampler's uniforms.
    a = jax.random.uniform(rng.stream_key(3, "prompts", 5), (8,))
    b = jax.random.uniform(rng.stream_key(3, "sample", 5), (8,))
    assert not np.allclose(a, b)


def test_stream_key_is_a_pure_function():
    assert _bits(rng.stream_key(7, "update", 11)) == _bits(rng.stream_key(7, "update", 11))
    with pytest.raises(ValueError, match="unknown random purpose"):
        rng.stream_key(0, "dropout", 0)
