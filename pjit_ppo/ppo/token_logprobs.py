"""Log-probability of chosen tokens, and the entropy, with one exp pass over the vocab.

Over a 50k vocabulary the exp of the logits costs as much as a large matmul on
CPU. Autodiff of logsumexp evaluates it again in the backward pass (softmax), and
an entropy metric would evaluate it a third time; here the forward pass keeps the
softmax it computes and the backward pass reuses it (d logp / d logits =
onehot - softmax), so each training step pays for one exp pass.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def token_logprobs_and_entropy(logits: jax.Array, tokens: jax.Array):
    """(log softmax(logits)[token], entropy of softmax(logits)) per position.

    logits: float32 [..., V]; tokens: int [...]. Returns two float32 [...] arrays.
    The entropy carries no gradient (it is a metric): its cotangent is ignored.
    """
    out, _ = _forward(logits, tokens)
    return out


def _forward(logits, tokens):
    logits = logits.astype(jnp.float32)
    top = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - top)
    # Sums over the vocabulary as matrix-vector products: XLA:CPU runs these as
    # dots at full speed, while its reduce fusions over 50k columns are slow.
    ones = jnp.ones(e.shape[-1], e.dtype)
    total = jnp.einsum("...v,v->...", e, ones)[..., None]
    probs = e / total
    logz = (top + jnp.log(total))[..., 0]
    picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    entropy = logz - jnp.einsum("...v,v->...", probs * logits, ones)
    return (picked - logz, entropy), (probs, tokens)


def _backward(residuals, cotangents):
    probs, tokens = residuals
    g_logprobs, _ = cotangents  # entropy is a metric: no gradient through it
    onehot = jax.nn.one_hot(tokens, probs.shape[-1], dtype=probs.dtype)
    return (g_logprobs[..., None] * (onehot - probs), None)


token_logprobs_and_entropy.defvjp(_forward, _backward)
