"""TF-style Adam, LR schedule and the PPO optimizer chain."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pjit_ppo import optim


def _np_tf_adam(grads, lr, b1=0.9, b2=0.999, eps=1e-5):
    """Parameter deltas of TF Adam (eps on the uncorrected second moment)."""
    m = np.zeros_like(grads[0])
    v = np.zeros_like(grads[0])
    deltas = []
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        lr_t = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        deltas.append(-lr_t * m / (np.sqrt(v) + eps))
    return deltas


def _grads(seed, n=5, scale=1e-4):
    rng = np.random.default_rng(seed)
    return [
        {"w": (scale * rng.normal(size=(3, 4))), "b": (scale * rng.normal(size=(4,)))}
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tf_adam_matches_numpy(seed):
    grads = _grads(seed)
    tx = optax.chain(optim.scale_by_tf_adam(eps=1e-5), optax.scale(-1e-3))
    params = jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), grads[0])
    state = tx.init(params)
    assert isinstance(state[0], optim.TfAdamState)
    assert jax.tree.structure(state[0].mu) == jax.tree.structure(params)
    assert jax.tree.map(lambda x: x.shape, state[0].nu) == jax.tree.map(lambda x: x.shape, params)
    update = jax.jit(tx.update)
    refs = {k: _np_tf_adam([g[k] for g in grads], 1e-3) for k in ("w", "b")}
    for t, g in enumerate(grads):
        g32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
        upd, state = update(g32, state)
        for k in ("w", "b"):
            np.testing.assert_allclose(upd[k], refs[k][t], rtol=1e-4, atol=1e-12)
    assert int(state[0].count) == len(grads)


def test_tf_adam_differs_from_optax_adam_early():
    # With gradients ~ eps the placement of eps dominates; at t=1 TF-style divides
    # by sqrt(1-b2)*|g| + eps instead of |g| + eps.
    g = {"w": jnp.full((2,), 1e-5, jnp.float32)}
    tf_state = optim.scale_by_tf_adam(eps=1e-5).init(g)
    pt_state = optax.scale_by_adam(eps=1e-5).init(g)
    tf_upd, _ = optim.scale_by_tf_adam(eps=1e-5).update(g, tf_state)
    pt_upd, _ = optax.scale_by_adam(eps=1e-5).update(g, pt_state)
    # PyTorch/optax: m_hat/(sqrt(v_hat)+eps) = 1e-5/(1e-5+1e-5) = 0.5.
    np.testing.assert_allclose(pt_upd["w"], 0.5, rtol=1e-5)
    # TF: sqrt(1-b2)/(1-b1) * m/(sqrt(v)+eps) = sqrt(.001)/.1 * 1e-6/(sqrt(.001)*1e-5+1e-5)
    expected = np.sqrt(1e-3) / 0.1 * 1e-6 / (np.sqrt(1e-3) * 1e-5 + 1e-5)
    np.testing.assert_allclose(tf_upd["w"], expected, rtol=1e-5)
    assert float(pt_upd["w"][0]) > 2.0 * float(tf_upd["w"][0])
    # For large gradients both agree closely (eps negligible).
    big = {"w": jnp.full((2,), 1.0, jnp.float32)}
    a, _ = optim.scale_by_tf_adam(eps=1e-5).update(big, tf_state)
    b, _ = optax.scale_by_adam(eps=1e-5).update(big, pt_state)
    np.testing.assert_allclose(a["w"], b["w"], rtol=1e-3)


def test_tf_adam_vs_optax_adam_over_steps():
    # Small gradients: optax.adam's early steps are several times larger.
    grads = [g["w"] for g in _grads(3, n=5, scale=1e-5)]
    tf_tx = optax.chain(optim.scale_by_tf_adam(eps=1e-5), optax.scale(-1e-3))
    pt_tx = optax.adam(1e-3, eps=1e-5)
    tf_state = tf_tx.init(jnp.zeros((3, 4)))
    pt_state = pt_tx.init(jnp.zeros((3, 4)))
    ref = _np_tf_adam(grads, 1e-3)
    for t, g in enumerate(grads):
        g = jnp.asarray(g, jnp.float32)
        tf_upd, tf_state = tf_tx.update(g, tf_state)
        pt_upd, pt_state = pt_tx.update(g, pt_state)
        np.testing.assert_allclose(tf_upd, ref[t], rtol=1e-4)
        ratio = np.abs(np.asarray(pt_upd)).mean() / np.abs(np.asarray(tf_upd)).mean()
        assert ratio > 1.5, (t, ratio)


def test_lr_schedule_constant_within_update_and_reaches_zero():
    sched = optim.make_lr_schedule(learning_rate=1e-5, num_updates=4, steps_per_update=3)
    lrs = np.array([float(sched(s)) for s in range(15)])
    expected = 1e-5 * np.array([1.0] * 3 + [0.75] * 3 + [0.5] * 3 + [0.25] * 3 + [0.0] * 3)
    np.testing.assert_allclose(lrs, expected, rtol=1e-6, atol=0)
    assert float(jax.jit(sched)(100)) == 0.0
    const = optim.make_lr_schedule(learning_rate=1e-5, num_updates=4, anneal_lr=False)
    assert float(const(11)) == pytest.approx(1e-5)


@pytest.mark.parametrize("kind", ["tf_adam", "adam"])
def test_make_optimizer_end_to_end(kind):
    lr, num_updates, spu = 1e-3, 3, 2
    tx = optim.make_optimizer(
        learning_rate=lr, num_updates=num_updates, kind=kind, steps_per_update=spu
    )
    grads = _grads(7, n=num_updates * spu, scale=1.0)
    params = jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), grads[0])
    state = tx.init(params)
    np.testing.assert_allclose(optim.current_lr(state), lr)

    @jax.jit
    def step(params, state, g):
        upd, state = tx.update(g, state, params)
        return optax.apply_updates(params, upd), state, upd

    ref_m = {k: np.zeros_like(grads[0][k]) for k in grads[0]}
    ref_v = {k: np.zeros_like(grads[0][k]) for k in grads[0]}
    lrs = []
    for s, g in enumerate(grads):
        g32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
        params, state, upd = step(params, state, g32)
        lrs.append(float(optim.current_lr(state)))
        lr_s = lr * (1 - (s // spu) / num_updates)
        t = s + 1
        for k in g:
            ref_m[k] = 0.9 * ref_m[k] + 0.1 * g[k]
            ref_v[k] = 0.999 * ref_v[k] + 0.001 * g[k] ** 2
            if kind == "tf_adam":
                ref = ref_m[k] * np.sqrt(1 - 0.999**t) / (1 - 0.9**t) / (np.sqrt(ref_v[k]) + 1e-5)
            else:
                ref = (ref_m[k] / (1 - 0.9**t)) / (np.sqrt(ref_v[k] / (1 - 0.999**t)) + 1e-5)
            np.testing.assert_allclose(upd[k], -lr_s * ref, rtol=1e-4, atol=1e-10)
    np.testing.assert_allclose(lrs, lr * np.array([1, 1, 2 / 3, 2 / 3, 1 / 3, 1 / 3]), rtol=1e-6)


def test_make_optimizer_grad_clipping():
    max_norm = 0.5
    g = {"w": jnp.full((4,), 3.0, jnp.float32), "b": jnp.full((2,), -4.0, jnp.float32)}
    gnorm = float(optax.tree.norm(g))
    clipped = jax.tree.map(lambda x: x * max_norm / gnorm, g)
    # Compare against an explicit chain fed the pre-clipped gradient.
    tx = optim.make_optimizer(
        learning_rate=1e-2, num_updates=10, max_grad_norm=max_norm, kind="tf_adam", eps=1.0
    )
    ref_tx = optax.chain(optim.scale_by_tf_adam(eps=1.0), optax.scale(-1e-2))
    params = jax.tree.map(jnp.zeros_like, g)
    upd, state = jax.jit(tx.update)(g, tx.init(params), params)
    ref_upd, _ = ref_tx.update(clipped, ref_tx.init(params))
    unclipped_upd, _ = ref_tx.update(g, ref_tx.init(params))
    for k in g:
        np.testing.assert_allclose(upd[k], ref_upd[k], rtol=1e-5)
        # eps=1 makes the update depend on the gradient scale, so clipping is visible.
        assert not np.allclose(upd[k], unclipped_upd[k], rtol=1e-2)
    # The Adam moments saw the clipped gradient.
    mu = state.inner_state[1].mu
    np.testing.assert_allclose(mu["w"], 0.1 * clipped["w"], rtol=1e-5)


def test_make_optimizer_rejects_unknown_kind():
    with pytest.raises(ValueError):
        optim.make_optimizer(learning_rate=1e-5, num_updates=1, kind="sgd")
