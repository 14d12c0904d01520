"""A dense projection x @ w whose weight gradient is laid out for XLA:CPU.

Autodiff of `x @ w` forms the weight gradient as x^T @ dy, a contraction over the
tokens of two token-major arrays. XLA:CPU runs that with one operand copied into
the transposed layout, and it picks the output gradient dy for that copy: for a
gated MLP's gate and up projections (dy [tokens, d_ff]) that is a strided write of
the whole [d_ff, tokens] array, fused into the activation's backward, per layer and
per step. Here, on CPU, the backward transposes the smaller of x and dy itself, behind
an optimization barrier so the transpose is not folded back into the dot, and runs the
weight gradient as a plain matmul with the tokens as the contracting dimension of
the right-hand side. Other platforms (whose matmuls take transposed operands as they
are) get autodiff's own contraction. The arithmetic is the same dot products; only the
float32 summation order inside the matmul may differ.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def _dims(n_lead: int, n_in: int, n_out: int):
    lead = tuple(range(n_lead))
    x_in = tuple(range(n_lead, n_lead + n_in))
    w_in = tuple(range(n_in))
    w_out = tuple(range(n_in, n_in + n_out))
    y_out = tuple(range(n_lead, n_lead + n_out))
    return lead, x_in, w_in, w_out, y_out


def _forward(x, w, n_in):
    n_lead = x.ndim - n_in
    _, x_in, w_in, _, _ = _dims(n_lead, n_in, w.ndim - n_in)
    return jax.lax.dot_general(x, w, ((x_in, w_in), ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def project(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    """x [*lead, *in] @ w [*in, *out] -> [*lead, *out], contracting the `n_in` dims.

    Same dtype rules as `jnp.tensordot(x, w, n_in)` (x and w in one dtype: the
    compute dtype). Differentiable in x and w.
    """
    return _forward(x, w, n_in)


def _project_fwd(x, w, n_in):
    return _forward(x, w, n_in), (x, w)


def _project_bwd(n_in, residuals, dy):
    x, w = residuals
    n_lead, n_out = x.ndim - n_in, w.ndim - n_in
    lead, x_in, w_in, w_out, y_out = _dims(n_lead, n_in, n_out)
    dx = jax.lax.dot_general(dy, w, ((y_out, w_out), ((), ())))
    size_in = math.prod(x.shape[n_lead:])
    size_out = math.prod(dy.shape[n_lead:])

    def transposed_operand(x, dy):  # XLA:CPU: no strided copy of the larger operand
        if size_in <= size_out:  # [*in, *lead] @ [*lead, *out]
            xt = jax.lax.optimization_barrier(jnp.transpose(x, x_in + lead))
            return jax.lax.dot_general(xt, dy, ((tuple(range(n_in, n_in + n_lead)), lead),
                                                ((), ())))
        # ([*out, *lead] @ [*lead, *in])^T
        dyt = jax.lax.optimization_barrier(jnp.transpose(dy, y_out + lead))
        dwt = jax.lax.dot_general(dyt, x, ((tuple(range(n_out, n_out + n_lead)), lead),
                                           ((), ())))
        return jnp.transpose(dwt, tuple(range(n_out, n_out + n_in)) + tuple(range(n_out)))

    def contraction(x, dy):  # what autodiff of tensordot computes
        return jax.lax.dot_general(x, dy, ((lead, lead), ((), ())))

    dw = jax.lax.platform_dependent(x, dy, cpu=transposed_operand, default=contraction)
    return dx.astype(x.dtype), dw.astype(w.dtype)


project.defvjp(_project_fwd, _project_bwd)
