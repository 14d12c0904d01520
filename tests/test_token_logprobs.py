"""The fused LM head + token log-prob / entropy against plain autodiff and numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjit_ppo.models import head_token_logprobs

D, V = 16, 97


def _inputs(vocab_major, with_bias, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    hidden = jax.random.normal(k[0], (4, 5, D))
    shape = (V, D) if vocab_major else (D, V)
    weight = 0.7 * jax.random.normal(k[1], shape)
    bias = jax.random.normal(k[2], (V,)) if with_bias else None
    # Repeated tokens, so the scatter-adds of the weight gradient must accumulate.
    tokens = jax.random.randint(k[3], (4, 5), 0, 7)
    g = jax.random.normal(k[4], (4, 5))
    return hidden, weight, bias, tokens, g


def _plain_logits(hidden, weight, bias, vocab_major):
    w = weight.T if vocab_major else weight
    logits = hidden @ w
    return logits if bias is None else logits + bias


@pytest.mark.parametrize("vocab_major,with_bias", [(True, False), (False, False), (False, True)])
def test_values_match_numpy(vocab_major, with_bias):
    hidden, weight, bias, tokens, _ = _inputs(vocab_major, with_bias)
    logp, ent = jax.jit(head_token_logprobs, static_argnames="vocab_major")(
        hidden, weight, bias, tokens, vocab_major=vocab_major)
    x = np.asarray(_plain_logits(hidden, weight, bias, vocab_major), np.float64)
    x = x - x.max(-1, keepdims=True)
    logsm = x - np.log(np.exp(x).sum(-1, keepdims=True))
    np.testing.assert_allclose(logp, np.take_along_axis(logsm, np.asarray(tokens)[..., None],
                                                        -1)[..., 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, -(np.exp(logsm) * logsm).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab_major,with_bias", [(True, False), (False, False), (False, True)])
def test_gradients_match_autodiff(vocab_major, with_bias):
    hidden, weight, bias, tokens, g = _inputs(vocab_major, with_bias, seed=1)

    def ours(h, w, b):
        lp, ent = head_token_logprobs(h, w, b, tokens, vocab_major=vocab_major)
        return jnp.sum(g * lp) + 0.0 * jnp.sum(ent)

    def plain(h, w, b):
        logsm = jax.nn.log_softmax(_plain_logits(h, w, b, vocab_major), axis=-1)
        return jnp.sum(g * jnp.take_along_axis(logsm, tokens[..., None], -1)[..., 0])

    argnums = (0, 1, 2) if with_bias else (0, 1)
    got = jax.jit(jax.grad(ours, argnums=argnums))(hidden, weight, bias)
    want = jax.grad(plain, argnums=argnums)(hidden, weight, bias)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("vocab_major,with_bias", [(True, False), (False, True)])
def test_scale_divides_float32_logits_values_and_gradients(vocab_major, with_bias):
    """scale = 1 / temperature multiplies the float32 logits (bias included)."""
    hidden, weight, bias, tokens, g = _inputs(vocab_major, with_bias, seed=3)
    scale = 1.0 / 0.7

    def ours(h, w, b):
        return jnp.sum(g * head_token_logprobs(h, w, b, tokens, vocab_major=vocab_major,
                                               scale=scale)[0])

    def plain(h, w, b):
        logsm = jax.nn.log_softmax(_plain_logits(h, w, b, vocab_major) * scale, axis=-1)
        return jnp.sum(g * jnp.take_along_axis(logsm, tokens[..., None], -1)[..., 0])

    np.testing.assert_allclose(ours(hidden, weight, bias), plain(hidden, weight, bias),
                               rtol=1e-5)
    argnums = (0, 1, 2) if with_bias else (0, 1)
    got = jax.jit(jax.grad(ours, argnums=argnums))(hidden, weight, bias)
    want = jax.grad(plain, argnums=argnums)(hidden, weight, bias)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_scale_is_not_rounded_to_the_compute_dtype():
    """In bf16 compute 1/0.7 must not become bf16(1/0.7) = 1.4296875 (an effective T of
    0.69945): the logits are scaled in float32."""
    hidden, weight, _, tokens, _ = _inputs(True, False, seed=4)
    h16 = hidden.astype(jnp.bfloat16)
    got = head_token_logprobs(h16, weight, None, tokens, vocab_major=True, scale=1 / 0.7)[0]
    w16 = np.asarray(weight.astype(jnp.bfloat16), np.float64)
    logits = np.asarray(h16, np.float64) @ w16.T  # bf16 inputs, exact accumulation
    x = logits / 0.7
    x = x - x.max(-1, keepdims=True)
    want = np.take_along_axis(x - np.log(np.exp(x).sum(-1, keepdims=True)),
                              np.asarray(tokens)[..., None], -1)[..., 0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    rounded = x * 0.7 * float(jnp.bfloat16(1 / 0.7))
    rounded = np.take_along_axis(rounded - np.log(np.exp(rounded).sum(-1, keepdims=True)),
                                 np.asarray(tokens)[..., None], -1)[..., 0]
    assert np.abs(rounded - want).max() > 10 * np.abs(np.asarray(got) - want).max()


def test_entropy_carries_no_gradient():
    hidden, weight, _, tokens, _ = _inputs(True, False)
    g = jax.grad(lambda h: jnp.sum(head_token_logprobs(h, weight, None, tokens,
                                                       vocab_major=True)[1]))(hidden)
    np.testing.assert_array_equal(g, np.zeros_like(g))


def test_low_precision_hidden_keeps_float32_weight_gradient():
    hidden, weight, _, tokens, g = _inputs(True, False, seed=2)

    def loss(h, w):
        return jnp.sum(g * head_token_logprobs(h, w, None, tokens, vocab_major=True)[0])

    dh, dw = jax.grad(loss, argnums=(0, 1))(hidden.astype(jnp.bfloat16), weight)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    want = jax.grad(loss, argnums=1)(hidden, weight)
    np.testing.assert_allclose(dw, want, rtol=0.05, atol=0.02)
