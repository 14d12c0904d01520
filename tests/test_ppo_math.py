"""PPO math (GAE, whitening, losses, KL controllers) vs numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjit_ppo.config import ConfigError, PPOConfig
from pjit_ppo.ppo import estimators as adv_lib
from pjit_ppo.ppo import kl as kl_lib
from pjit_ppo.ppo import losses
from pjit_ppo.ppo.masked import masked_mean, masked_var

SHAPES = [(1, 1), (3, 7), (8, 24)]
SEEDS = [0, 1, 2]


def _rand(seed, shape, n=1):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype(np.float32) for _ in range(n)], rng


def _np_gae(rewards, values, gamma, lam):
    b, t = rewards.shape
    adv = np.zeros((b, t), np.float64)
    for i in range(b):
        last = 0.0
        for s in reversed(range(t)):
            next_v = values[i, s + 1] if s + 1 < t else 0.0
            delta = rewards[i, s] + gamma * next_v - values[i, s]
            last = delta + gamma * lam * last
            adv[i, s] = last
    return adv, adv + values


def _np_masked_mean(x, m):
    return (x * m).sum() / m.sum()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5)])
def test_gae_matches_loop(shape, seed, gamma, lam):
    (r, v), _ = _rand(seed, shape, 2)
    adv, ret = jax.jit(adv_lib.gae)(r, v, gamma, lam)
    ref_adv, ref_ret = _np_gae(r.astype(np.float64), v.astype(np.float64), gamma, lam)
    assert adv.shape == shape and ret.shape == shape
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_hand_example():
    # gamma=1, lam=1: advantage = reward-to-go - V(s_t).
    r = np.array([[1.0, 2.0, 3.0]], np.float32)
    v = np.array([[0.5, 0.0, 1.0]], np.float32)
    adv, ret = adv_lib.gae(r, v, 1.0, 1.0)
    np.testing.assert_allclose(adv, [[5.5, 5.0, 2.0]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[6.0, 5.0, 3.0]], rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten(seed, shift_mean):
    (x,), _ = _rand(seed, (6, 10))
    x = 3.0 * x + 2.0
    got = jax.jit(adv_lib.whiten, static_argnums=1)(x, shift_mean)
    xd = x.astype(np.float64)
    mean, var = xd.mean(), xd.var()
    ref = (xd - mean) / np.sqrt(var + 1e-8)
    if not shift_mean:
        ref = ref + mean
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    if shift_mean:
        assert abs(float(got.mean())) < 1e-5
    else:
        np.testing.assert_allclose(float(got.mean()), mean, rtol=1e-5)
    np.testing.assert_allclose(float(got.std()), 1.0, rtol=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_masked(seed, shift_mean):
    (x,), rng = _rand(seed, (5, 9))
    mask = rng.random((5, 9)) > 0.4
    mask[0, 0] = True
    x_bad = np.where(mask, x, 1e6).astype(np.float32)  # padding garbage must not matter
    got = jax.jit(lambda x, m: adv_lib.whiten(x, shift_mean, mask=m))(x_bad, mask)
    sel = x[mask].astype(np.float64)
    mean, var = sel.mean(), sel.var()
    ref = (sel - mean) / np.sqrt(var + 1e-8)
    if not shift_mean:
        ref = ref + mean
    np.testing.assert_allclose(np.asarray(got)[mask], ref, rtol=1e-5, atol=1e-5)


def test_masked_mean_var_axis_and_empty():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    m = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]], np.float32)
    np.testing.assert_allclose(masked_mean(x, m, axis=1), [0.5, 0.0, (8 + 10 + 11) / 3])
    np.testing.assert_allclose(
        masked_var(x, m, axis=1), [0.25, 0.0, np.var([8, 10, 11])], rtol=1e-6
    )
    np.testing.assert_allclose(masked_mean(x, m), x[m > 0].mean(), rtol=1e-6)
    np.testing.assert_allclose(masked_var(x, m), x[m > 0].var(), rtol=1e-6)
    np.testing.assert_allclose(masked_mean(x, None), x.mean())


def _np_policy_loss(new, old, adv, m, c):
    ratio = np.exp(new - old)
    l1 = -adv * ratio
    l2 = -adv * np.clip(ratio, 1 - c, 1 + c)
    return {
        "loss": _np_masked_mean(np.maximum(l1, l2), m),
        "approxkl": 0.5 * _np_masked_mean((new - old) ** 2, m),
        "clipfrac": _np_masked_mean((l2 > l1).astype(np.float64), m),
        "ratio": _np_masked_mean(ratio, m),
        "ratio_var": _np_masked_mean((ratio - _np_masked_mean(ratio, m)) ** 2, m),
    }


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(4, 6), (16, 24)])
def test_policy_loss(seed, shape):
    (old, adv, noise), rng = _rand(seed, shape, 3)
    new = old + 0.3 * noise  # ratios spread around 1, so clipping is exercised
    mask = (rng.random(shape) > 0.3).astype(np.float32)
    loss, stats = jax.jit(losses.policy_loss)(new, old, adv, mask, 0.2)
    ref = _np_policy_loss(*(a.astype(np.float64) for a in (new, old, adv, mask)), 0.2)
    assert 0.05 < ref["clipfrac"] < 0.95
    np.testing.assert_allclose(loss, ref["loss"], rtol=1e-5, atol=1e-6)
    for k, v in ref.items():
        np.testing.assert_allclose(stats[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert all(s.shape == () for s in stats.values())


def test_policy_loss_on_policy_is_minus_mean_advantage():
    (old, adv), _ = _rand(3, (4, 5), 2)
    mask = np.ones((4, 5), bool)
    loss, stats = losses.policy_loss(old, old, adv, mask, 0.2)
    np.testing.assert_allclose(loss, -adv.mean(), rtol=1e-5, atol=1e-6)
    assert float(stats["approxkl"]) == 0.0 and float(stats["clipfrac"]) == 0.0
    np.testing.assert_allclose(stats["ratio"], 1.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss(seed):
    shape = (8, 12)
    (old_v, noise, ret), rng = _rand(seed, shape, 3)
    new_v = old_v + 0.4 * noise
    mask = rng.random(shape) > 0.25
    loss, stats = jax.jit(losses.value_loss)(new_v, old_v, ret, mask, 0.2)
    n, o, r, m = (a.astype(np.float64) for a in (new_v, old_v, ret, mask))
    clipped = o + np.clip(n - o, -0.2, 0.2)
    l1, l2 = (n - r) ** 2, (clipped - r) ** 2
    ref_loss = 0.5 * _np_masked_mean(np.maximum(l1, l2), m)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(stats["loss"], ref_loss, rtol=1e-5)
    np.testing.assert_allclose(stats["clipfrac"], _np_masked_mean(l2 > l1, m), rtol=1e-6)
    np.testing.assert_allclose(stats["error"], _np_masked_mean(l1, m), rtol=1e-5)
    np.testing.assert_allclose(stats["vpred"], _np_masked_mean(n, m), rtol=1e-5, atol=1e-6)
    assert 0.0 < float(stats["clipfrac"]) < 1.0


@pytest.mark.parametrize("seed", SEEDS)
def test_adaptive_kl_controller(seed):
    cfg = PPOConfig(kl_controller="adaptive", init_kl_coef=0.15, kl_target=6.0, kl_horizon=10000)
    rng = np.random.default_rng(seed)
    kls = rng.uniform(0.0, 15.0, size=20)
    update = jax.jit(lambda c, k: kl_lib.kl_update(cfg, c, k, 512))
    coef = kl_lib.kl_init(cfg)
    assert coef.dtype == jnp.float32 and float(coef) == pytest.approx(0.15)
    ref = 0.15
    for k in kls:
        coef = update(coef, k)
        err = np.clip(k / 6.0 - 1.0, -0.2, 0.2)
        ref *= 1.0 + err * 512 / 10000
        np.testing.assert_allclose(float(coef), ref, rtol=1e-5)
    assert float(coef) != pytest.approx(0.15)


def test_adaptive_kl_direction_and_clip():
    cfg = PPOConfig()
    # KL far above target: error clipped at +0.2.
    np.testing.assert_allclose(kl_lib.kl_update(cfg, 0.15, 100.0, 1000), 0.15 * 1.02, rtol=1e-6)
    # KL = 0: error clipped at -0.2.
    np.testing.assert_allclose(kl_lib.kl_update(cfg, 0.15, 0.0, 1000), 0.15 * 0.98, rtol=1e-6)
    np.testing.assert_allclose(kl_lib.kl_update(cfg, 0.15, 6.0, 1000), 0.15, rtol=1e-6)


def test_fixed_kl_controller_and_validation():
    cfg = PPOConfig(kl_controller="fixed", init_kl_coef=0.05)
    coef = kl_lib.kl_init(cfg)
    for k in [0.0, 3.0, 50.0]:
        coef = jax.jit(lambda c, k: kl_lib.kl_update(cfg, c, k, 512))(coef, k)
    np.testing.assert_allclose(float(coef), 0.05, rtol=1e-7)
    with pytest.raises(ConfigError, match="ppo.kl_controller='linear'"):
        PPOConfig(kl_controller="linear")


# ---------------------------------------------------------------- policy-loss options

def _np_aggregate(x, m, how):
    if how == "token_mean":
        return (x * m).sum() / m.sum()
    if how == "sequence_mean":
        return np.mean([(x[i] * m[i]).sum() / m[i].sum() for i in range(len(x))])
    return np.mean((x * m).sum(1)) / x.shape[1]  # sequence_sum, Dr. GRPO's constant


def _prefix_mask(rng, shape):
    return np.arange(shape[1])[None, :] <= rng.integers(0, shape[1], size=(shape[0], 1))


@pytest.mark.parametrize("how", ["token_mean", "sequence_mean", "sequence_sum"])
def test_aggregate(how):
    (x,), rng = _rand(4, (5, 7))
    mask = _prefix_mask(rng, x.shape)
    got = jax.jit(losses.aggregate, static_argnums=2)(x, mask, how)
    np.testing.assert_allclose(got, _np_aggregate(x.astype(np.float64), mask, how), rtol=1e-5)
    full = np.ones_like(mask)
    np.testing.assert_allclose(losses.aggregate(x, full, how), x.mean(), rtol=1e-5)
    with pytest.raises(ValueError, match="loss aggregation 'sum'"):
        losses.aggregate(x, mask, "sum")


def test_aggregations_weigh_tokens_differently():
    x = np.array([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]], bool)
    assert float(losses.aggregate(x, mask, "token_mean")) == pytest.approx(7 / 5)
    assert float(losses.aggregate(x, mask, "sequence_mean")) == pytest.approx(2.0)
    assert float(losses.aggregate(x, mask, "sequence_sum")) == pytest.approx(7 / 8)


@pytest.mark.parametrize("seed", SEEDS)
def test_decoupled_clipping(seed):
    """DAPO's clip-higher: the ratio is clipped to [1 - low, 1 + high]."""
    (old, adv, noise), rng = _rand(seed, (8, 12), 3)
    new = old + 0.3 * noise
    mask = _prefix_mask(rng, (8, 12))
    low, high = 0.1, 0.3
    loss, stats = jax.jit(losses.policy_loss, static_argnums=(6, 7))(
        new, old, adv, mask, low, high, "token", "sequence_mean")
    n, o, a = (v.astype(np.float64) for v in (new, old, adv))
    ratio = np.exp(n - o)
    l1, l2 = -a * ratio, -a * np.clip(ratio, 1 - low, 1 + high)
    np.testing.assert_allclose(loss, _np_aggregate(np.maximum(l1, l2), mask, "sequence_mean"),
                               rtol=1e-5, atol=1e-6)
    clipped = l2 > l1
    np.testing.assert_allclose(stats["clipfrac"], _np_masked_mean(clipped, mask), rtol=1e-6)
    np.testing.assert_allclose(stats["clipfrac_low"],
                               _np_masked_mean(clipped & (ratio < 1 - low), mask), rtol=1e-6)
    np.testing.assert_allclose(stats["clipfrac_high"],
                               _np_masked_mean(clipped & (ratio > 1 + high), mask), rtol=1e-6)
    assert float(stats["clipfrac_low"]) > 0 and float(stats["clipfrac_high"]) > 0
    # Symmetric when high is not given: the original loss.
    sym, _ = losses.policy_loss(new, old, adv, mask, 0.2)
    same, _ = losses.policy_loss(new, old, adv, mask, 0.2, 0.2)
    assert float(sym) == float(same)


def _np_gspo_loss(new, old, adv_seq, mask, low, high):
    """GSPO (Zheng et al. 2025): s_i = exp(mean_t (logp - logp_old)); loss =
    -mean_i min(s_i A_i, clip(s_i, 1 - low, 1 + high) A_i)."""
    s = np.exp(np.array([(new[i] - old[i])[mask[i]].mean() for i in range(len(new))]))
    return np.mean(np.maximum(-adv_seq * s, -adv_seq * np.clip(s, 1 - low, 1 + high)))


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_importance_ratio_is_gspo(seed):
    """With one advantage per sequence and sequence_mean aggregation, the loss and its
    gradient are GSPO's sequence-level objective."""
    (old, noise), rng = _rand(seed, (6, 10), 2)
    new = old + 0.05 * noise
    adv_seq = rng.normal(size=6).astype(np.float32)
    mask = _prefix_mask(rng, (6, 10))
    adv = np.where(mask, adv_seq[:, None], 0).astype(np.float32)
    low, high = 3e-3, 4e-3  # GSPO-sized ranges, so some sequences clip and some do not

    def ours(new):
        return losses.policy_loss(new, old, adv, mask, low, high, "sequence",
                                  "sequence_mean")[0]

    def direct(new):  # GSPO written on the sequence ratio itself, no stop-gradient trick
        s = jnp.exp(jnp.sum(jnp.where(mask, new - old, 0), 1) / mask.sum(1))
        return jnp.mean(jnp.maximum(-adv_seq * s, -adv_seq * jnp.clip(s, 1 - low, 1 + high)))

    np.testing.assert_allclose(ours(new), _np_gspo_loss(new.astype(np.float64), old, adv_seq,
                                                        mask, low, high), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(ours)(new), jax.grad(direct)(new), rtol=1e-4,
                               atol=1e-6)
    _, stats = losses.policy_loss(new, old, adv, mask, low, high, "sequence", "sequence_mean")
    assert 0 < float(stats["clipfrac"]) < 1
    # Every token of a sequence shares its ratio, so clipping is decided per sequence.
    s = np.exp(np.array([(new[i] - old[i])[mask[i]].mean() for i in range(6)]))
    np.testing.assert_allclose(stats["ratio"], _np_masked_mean(np.broadcast_to(
        s[:, None], mask.shape), mask), rtol=1e-5)


def test_k3_kl():
    (lp, noise), _ = _rand(5, (4, 6), 2)
    ref = lp + noise
    got = np.asarray(losses.k3_kl(lp, ref), np.float64)
    d = ref.astype(np.float64) - lp
    np.testing.assert_allclose(got, np.exp(d) - d - 1, rtol=1e-5, atol=1e-6)
    assert (got >= 0).all()
    assert np.all(np.asarray(losses.k3_kl(lp, lp)) == 0)
