"""The fused token log-prob / entropy against plain autodiff and numpy."""
import jax
import jax.numpy as jnp
import numpy as np

from pjit_ppo.ppo.token_logprobs import token_logprobs_and_entropy


def _reference(logits, tokens):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def test_values_and_gradient_match_autodiff():
    key = jax.random.PRNGKey(0)
    logits = 3.0 * jax.random.normal(key, (4, 5, 97))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 5), 0, 97)
    logp, ent = jax.jit(token_logprobs_and_entropy)(logits, tokens)
    np.testing.assert_allclose(logp, _reference(logits, tokens), rtol=1e-5, atol=1e-5)
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(ent, -(p * np.log(p)).sum(-1), rtol=1e-5, atol=1e-5)

    weights = jax.random.normal(jax.random.PRNGKey(2), (4, 5))

    def ours(lg):
        lp, e = token_logprobs_and_entropy(lg, tokens)
        return jnp.sum(weights * lp) + 0.0 * jnp.sum(e)

    def plain(lg):
        return jnp.sum(weights * _reference(lg, tokens))

    np.testing.assert_allclose(jax.jit(jax.grad(ours))(logits), jax.grad(plain)(logits),
                               rtol=1e-5, atol=1e-6)


def test_entropy_carries_no_gradient():
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 11))
    tokens = jnp.array([1, 2, 3])
    g = jax.grad(lambda lg: jnp.sum(token_logprobs_and_entropy(lg, tokens)[1]))(logits)
    np.testing.assert_array_equal(g, np.zeros_like(g))
