"""FLOP formula against hand counts and XLA's cost analysis; peak measurement (square and
model-shaped: the dots of a PPO phase, their FLOP weights, interleaved samples). No timing
assertions."""
import math

import jax
import jax.numpy as jnp
import pytest

from pjit_ppo import flops


def test_formula_hand_computation():
    # d=8, 2 heads of 4, d_ff=32, vocab 10, seq 5, 3 layers.
    # per layer: QKV 2*8*24=384, out 2*8*8=128, QK^T 2*8*5=80, AV 80,
    # MLP 2*2*8*32=1024 -> 1696; x3 = 5088; head 2*8*10=160 -> 5248.
    assert flops.transformer_flops_per_token(
        n_layers=3, d_model=8, n_heads=2, head_dim=4, d_ff=32, vocab_size=10,
        seq_len=5) == 5248.0
    assert flops.transformer_flops_per_token(
        3, 8, 2, 4, 32, 10, 5, lm_head=False) == 5088.0
    # Gated MLP with one KV head: QKV 2*8*(8+8)=256, out 128, attn 160,
    # MLP 3*2*8*32=1536 -> 2080 per layer; x3 + 160 = 6400.
    assert flops.transformer_flops_per_token(
        3, 8, 2, 4, 32, 10, 5, gated_mlp=True, n_kv_heads=1) == 6400.0


def _layer(x, wq, wk, wv, wo, w1, w2, w_head, n_heads):
    """One dense transformer layer (no norms) + LM head, plain jnp."""
    seq, d_model = x.shape
    head_dim = wq.shape[1] // n_heads
    split = lambda t: t.reshape(seq, -1, head_dim).transpose(1, 0, 2)
    q, k, v = split(x @ wq), split(x @ wk), split(x @ wv)
    scores = jnp.einsum("hqd,hkd->hqk", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(causal, scores, -1e9)
    attn = jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(scores, -1), v)
    x = x + attn.transpose(1, 0, 2).reshape(seq, -1) @ wo
    x = x + jax.nn.relu(x @ w1) @ w2
    return x @ w_head


def _cost_flops(fn, *args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one per module
        cost = cost[0]
    if not cost or "flops" not in cost:
        pytest.skip("backend gives no cost analysis")
    return cost["flops"]


def test_formula_matches_xla_cost_analysis():
    seq, d_model, n_heads, head_dim, d_ff, vocab = 128, 256, 4, 64, 1024, 512
    shapes = [(seq, d_model), (d_model, n_heads * head_dim),
              (d_model, n_heads * head_dim), (d_model, n_heads * head_dim),
              (n_heads * head_dim, d_model), (d_model, d_ff), (d_ff, d_model),
              (d_model, vocab)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    xla = _cost_flops(lambda *a: _layer(*a, n_heads=n_heads), *args)
    ours = seq * flops.transformer_flops_per_token(
        n_layers=1, d_model=d_model, n_heads=n_heads, head_dim=head_dim,
        d_ff=d_ff, vocab_size=vocab, seq_len=seq)
    assert ours == pytest.approx(xla, rel=0.03)


def test_measure_peak_flops_positive():
    peak = flops.measure_matmul_peak_flops(n=256, repeats=3)
    assert math.isfinite(peak) and peak > 0


def test_mfu():
    assert flops.mfu(1e12, 2.0, 1e12) == pytest.approx(0.5)
    assert flops.mfu(1e12, 0.0, 1e12) == 0.0


# ------------------------------------------------------------ model-shaped peak

def _models():
    from pjit_ppo.models import ModelConfig
    gpt2 = ModelConfig(architecture="gpt2", vocab_size=500, d_model=32, n_layers=3, n_heads=4,
                       n_kv_heads=4, head_dim=8, d_ff=128, max_positions=64,
                       position="learned", tie_word_embeddings=True)
    llama = ModelConfig(architecture="llama", vocab_size=300, d_model=48, n_layers=2, n_heads=4,
                        n_kv_heads=2, head_dim=12, d_ff=96, max_positions=64, norm="rmsnorm",
                        gated_mlp=True, rotary_dim=12, tie_word_embeddings=False)
    return gpt2, llama


def _ppo(**kw):
    from pjit_ppo.config import PPOConfig
    base = dict(query_length=12, response_length=6, truncate_token=None, batch_size=16,
                nminibatches=2, noptepochs=3, total_episodes=160, pad_token_id=0)
    return PPOConfig(**{**base, **kw})


@pytest.mark.parametrize("ppo_kw", [
    {},
    dict(rollout_micro_batch_size=8, gradient_accumulation_steps=2),
    dict(advantage_estimator="grpo", samples_per_prompt=4),
    dict(advantage_estimator="rloo", samples_per_prompt=4, rollout_micro_batch_size=4),
    dict(recompute_rollout_logprobs=False),
])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_phase_dots_are_the_counted_work(arch, ppo_kw):
    from pjit_ppo.ppo.types import PPOModels
    model = dict(zip(["gpt2", "llama"], _models()))[arch]
    cfg = _ppo(**ppo_kw)
    models = PPOModels(policy=model, critic=model if cfg.uses_critic else None, reward_fn=None)
    q, r = cfg.query_length, cfg.response_length
    reward_flops = flops.forward_flops(model, q + r, q + r, 0, last_layer_tokens=r + 1)
    want = flops.ppo_phase_flops(cfg, models, reward_flops)
    dots = flops.ppo_phase_dots(cfg, models, reward_model=model)
    assert set(dots) == {"rollout", "update"}
    for phase in dots:
        assert sum(d.flops for d in dots[phase]) == pytest.approx(want[phase], rel=1e-12)
        assert all(not d.name.startswith("update") for d in dots["rollout"])


def test_forward_dots_use_the_model_shapes():
    gpt2, llama = _models()
    rows, t = 5, 18
    by_name = {d.name: d for d in flops.forward_dots(gpt2, rows, t, t, 6, name="p")}
    assert (by_name["p/mlp_in"].m, by_name["p/mlp_in"].k, by_name["p/mlp_in"].n) == (90, 32, 128)
    assert (by_name["p/mlp_out"].m, by_name["p/mlp_out"].k, by_name["p/mlp_out"].n) == (90, 128, 32)
    assert by_name["p/q"].count == gpt2.n_layers and by_name["p/kv"].count == 2 * gpt2.n_layers
    head = by_name["p/lm_head"]
    assert (head.m, head.k, head.n, head.rhs_transposed) == (30, 32, 500, True)  # tied: [V, d]
    scores = by_name["p/scores"]
    assert (scores.batch, scores.m, scores.k, scores.n) == (rows * 4, t, 8, t)
    # Llama: gated MLP (two d x d_ff matmuls), grouped K/V, untied head; last layer sliced.
    dots = flops.forward_dots(llama, rows, t, t, 0, last_layer_tokens=6)
    mlp_in = [d for d in dots if d.name == "mlp_in"]
    assert [(d.m, d.count) for d in mlp_in] == [(rows * t, 2.0), (rows * 6, 2.0)]
    kv = [d for d in dots if d.name == "kv"]
    assert {(d.m, d.n) for d in kv} == {(rows * t, 24)}
    assert not any(d.name == "lm_head" for d in dots)
    assert sum(d.flops for d in dots) == pytest.approx(
        rows * flops.forward_flops(llama, t, t, 0, last_layer_tokens=6))


def test_training_dots_add_the_two_gradients():
    fwd = [flops.Dot("w", m=10, k=3, n=7), flops.Dot("tied", m=10, k=3, n=50, rhs_transposed=True)]
    dots = {d.name: d for d in flops.training_dots(fwd)}
    assert set(dots) == {"w", "w/dX", "w/dW", "tied", "tied/dX", "tied/dW"}
    dx, dw = dots["w/dX"], dots["w/dW"]
    assert (dx.m, dx.k, dx.n, dx.rhs_transposed) == (10, 7, 3, True)   # dY @ W^T
    assert (dw.m, dw.k, dw.n, dw.lhs_transposed) == (3, 10, 7, True)   # X^T @ dY
    tdx, tdw = dots["tied/dX"], dots["tied/dW"]
    assert (tdx.k, tdx.n, tdx.rhs_transposed) == (50, 3, False)        # dY @ W, W [50, 3]
    assert (tdw.m, tdw.k, tdw.n) == (50, 10, 3)                        # dY^T @ X
    assert sum(d.flops for d in dots.values()) == 3 * sum(d.flops for d in fwd)


def test_dot_weights_sum_to_one_and_merge_shapes():
    a = flops.Dot("a", 4, 8, 16, count=2)
    a_again = flops.Dot("a elsewhere", 4, 8, 16, count=1)
    b = flops.Dot("b", 4, 8, 16, rhs_transposed=True, count=1)
    w = flops.dot_weights([a, a_again, b])
    assert sum(w.values()) == pytest.approx(1.0)
    assert w == {a.shape_key: pytest.approx(0.75), b.shape_key: pytest.approx(0.25)}
    with pytest.raises(ValueError):
        flops.dot_weights([])


def test_mix_rate_is_the_flop_weighted_harmonic_mean():
    # Half the FLOPs at 100, half at 50: 1 FLOP takes 0.5/100 + 0.5/50 s.
    assert flops.mix_rate({"x": 100.0, "y": 50.0}, {"x": 0.5, "y": 0.5}) == pytest.approx(
        1 / (0.5 / 100 + 0.5 / 50))
    assert flops.mix_rate({"x": 80.0}, {"x": 1.0}) == pytest.approx(80.0)


@pytest.mark.parametrize("lhs_t,rhs_t,batch", [(False, False, 1), (True, False, 1),
                                               (False, True, 1), (False, True, 3),
                                               (True, False, 3)])
def test_dot_loop_computes_the_stated_product(lhs_t, rhs_t, batch):
    m, k, n = 5, 6, 7
    a = jax.random.normal(jax.random.PRNGKey(0), ((batch,) if batch > 1 else ())
                          + ((k, m) if lhs_t else (m, k)))
    b = jax.random.normal(jax.random.PRNGKey(1), ((batch,) if batch > 1 else ())
                          + ((n, k) if rhs_t else (k, n)))
    lhs = jnp.swapaxes(a, -1, -2) if lhs_t else a
    rhs = jnp.swapaxes(b, -1, -2) if rhs_t else b
    got = flops._dot_loop(lhs_t, rhs_t, batch > 1)(a, b, 3)
    assert got.shape == ((batch,) if batch > 1 else ()) + (m, n)
    assert jnp.allclose(got, lhs @ rhs, atol=1e-4)


def test_matmul_mix_peak_samples_and_median():
    dots = {"one": [flops.Dot("x", 16, 32, 8, count=3), flops.Dot("s", 4, 8, 6, batch=2,
                                                                     rhs_transposed=True)],
            "two": [flops.Dot("y", 16, 8, 32, lhs_transposed=True)]}
    peak = flops.MatmulMixPeak(dots, min_seconds=1e-4)
    assert set(peak.shapes) == {d.shape_key for ds in dots.values() for d in ds}
    for name in dots:
        assert sum(peak.weights[name].values()) == pytest.approx(1.0)
    peak.warm_up()
    for _ in range(3):  # before and after each of two timed intervals
        rates = peak.sample(rounds=2)
        assert set(rates) == {"one", "two"}
        assert all(math.isfinite(v) and v > 0 for v in rates.values())
    assert [len(g) for g in peak.gaps] == [2, 2, 2] and len(peak.samples) == 6
    assert all(set(smp) == set(peak.shapes) for smp in peak.shape_samples)
    assert all(v > 0 for v in peak.interval_mfu("one", 1e6, [1.0, 2.0]))
    with pytest.raises(ValueError, match="3 intervals need 4 gaps"):
        peak.interval_mfu("one", 1e6, [1.0, 1.0, 1.0])

    # Made-up rates: median() takes each shape's median over all samples; around(i) and
    # interval_mfu use only the gaps either side of interval i.
    x, s, y = (d.shape_key for d in (dots["one"][0], dots["one"][1], dots["two"][0]))
    peak.gaps = [[{x: 3.0, s: 10.0, y: 7.0}], [{x: 1.0, s: 30.0, y: 5.0}],
                 [{x: 2.0, s: 20.0, y: 6.0}, {x: 9.0, s: 0.5, y: 1.0}]]
    w = peak.weights["one"]
    assert peak.median() == {"one": pytest.approx(1 / (w[x] / 2.5 + w[s] / 15.0)),
                             "two": pytest.approx(5.5)}
    assert peak.around(0)["two"] == pytest.approx(6.0)
    assert peak.around(1)["two"] == pytest.approx(5.0)          # median of 5, 6, 1
    assert peak.interval_mfu("two", 60.0, [2.0, 3.0], devices=2) == [
        pytest.approx(60 / 2 / 12), pytest.approx(60 / 3 / 10)]
    assert peak.samples[1] == {"one": pytest.approx(1 / (w[x] / 1.0 + w[s] / 30.0)),
                               "two": pytest.approx(5.0)}
    assert flops.median_samples([{"a": 3.0}, {"a": 1.0}, {"a": 2.0}]) == {"a": 2.0}
    with pytest.raises(ValueError):
        flops.median_samples([])
