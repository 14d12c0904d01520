"""The dense projection's hand-laid-out backward against autodiff of tensordot and numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjit_ppo.models.projection import project

# (x shape, w shape, contracted dims): wider and narrower outputs (each branch of the
# weight gradient), multi-dimensional outputs (q/k/v heads) and inputs (attention out).
CASES = [((3, 5, 16), (16, 40), 1), ((3, 5, 40), (40, 16), 1),
         ((3, 5, 16), (16, 4, 8), 1), ((3, 5, 4, 8), (4, 8, 16), 2), ((7, 24), (24, 24), 1)]


def _loss(fn):
    def loss(x, w, n_in, g):
        return jnp.sum(fn(x, w, n_in) * g)
    return loss


@pytest.mark.parametrize("x_shape,w_shape,n_in", CASES)
def test_value_and_gradients_equal_autodiff_of_tensordot(x_shape, w_shape, n_in):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x, w = jax.random.normal(k[0], x_shape), jax.random.normal(k[1], w_shape)
    out_shape = x_shape[:len(x_shape) - n_in] + w_shape[n_in:]
    g = jax.random.normal(k[2], out_shape)
    np.testing.assert_allclose(jax.jit(project, static_argnums=2)(x, w, n_in),
                               np.tensordot(np.asarray(x), np.asarray(w), n_in),
                               rtol=1e-5, atol=1e-5)
    ours = jax.jit(jax.grad(_loss(project), (0, 1)), static_argnums=2)(x, w, n_in, g)
    plain = jax.grad(_loss(lambda a, b, n: jnp.tensordot(a, b, n)), (0, 1))(x, w, n_in, g)
    # numpy float64: dx = g . w^T over the output dims, dw = x^T . g over the leading dims.
    lead = len(x_shape) - n_in
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    want_dx = np.tensordot(g64, w64, (list(range(lead, g64.ndim)),
                                      list(range(n_in, w64.ndim))))
    want_dw = np.tensordot(x64, g64, (list(range(lead)), list(range(lead))))
    for got, autodiff, want in zip(ours, plain, (want_dx, want_dw)):
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, autodiff, rtol=1e-5, atol=1e-5)


def test_bfloat16_keeps_the_dtypes_of_tensordot():
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(k[0], (2, 6, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(k[1], (16, 32)).astype(jnp.bfloat16)
    g = jax.random.normal(k[2], (2, 6, 32)).astype(jnp.bfloat16)
    y = project(x, w, 1)
    assert y.dtype == jnp.tensordot(x, w, 1).dtype == jnp.bfloat16
    dx, dw = jax.grad(_loss(project), (0, 1))(x, w, 1, g)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    want = np.tensordot(np.asarray(x, np.float32), np.asarray(g, np.float32), ([0, 1], [0, 1]))
    np.testing.assert_allclose(np.asarray(dw, np.float32), want, rtol=2e-2, atol=2e-2)


def test_a_frozen_weight_gets_no_gradient_work():
    """Differentiating only x (a frozen base weight, as under LoRA) leaves no weight-
    gradient dot in the compiled program: XLA drops the unused branch."""
    x, w = jnp.ones((4, 8, 16)), jnp.ones((16, 64))
    g = jnp.ones((4, 8, 64))
    hlo = jax.jit(jax.grad(_loss(project)), static_argnums=2).lower(
        x, w, 1, g).compile().as_text()
    shapes = [line for line in hlo.splitlines() if " dot(" in line or "dot_general" in line]
    assert not any("f32[16,64]" in line.split("=")[1].split(" ")[1] for line in shapes
                   if "=" in line), shapes


def test_a_dots_remat_policy_saves_the_same_residuals_as_for_tensordot(capsys):
    """model.remat_policy names like "dots_saveable" still see the projection's matmul."""
    from jax.ad_checkpoint import print_saved_residuals

    def saved(dense):
        def f(x, w1, w2):
            return jnp.sum(jnp.tanh(dense(jnp.tanh(dense(x, w1, 1)), w2, 1)))
        capsys.readouterr()
        print_saved_residuals(jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable),
                              jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.ones((16, 8)))
        # "f32[4,16] output of dot_general from <file>:<line> (f)": shape and origin
        return [line.split(" from ")[0] for line in capsys.readouterr().out.splitlines()]

    ours = saved(project)
    assert ours == saved(lambda a, b, n: jnp.tensordot(a, b, n))
    assert ours.count("f32[4,16] output of dot_general") == 1, ours
    assert ours.count("f32[4,8] output of dot_general") == 1, ours
