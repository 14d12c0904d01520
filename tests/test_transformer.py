"""The decoder's layer stack: output_slice (last layer on some positions only), remat
policies, and the FLOP count of a sliced forward against XLA's cost analysis."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjit_ppo.models import transformer
from pjit_ppo.models.config import ModelConfig
from pjit_ppo import flops
import tiny_hf

BATCH, SEQ, SLICE = 3, 11, (6, 10)


def _config(variant, **overrides):
    family, hf_overrides = tiny_hf.VARIANTS[variant]
    config = ModelConfig.from_hf_dict(tiny_hf.hf_config(family, **hf_overrides).to_dict())
    return config.replace(**overrides) if overrides else config


def _inputs():
    ids = jax.random.randint(jax.random.PRNGKey(2), (BATCH, SEQ), 0, tiny_hf.VOCAB - 1)
    # left padding of 0, 2 and 5 tokens
    mask = jnp.arange(SEQ)[None] >= jnp.array([[0], [2], [5]])
    return ids, mask


def _max_rel_err(a_tree, b_tree):
    """Largest |a - b| over all leaves, relative to the largest |a| of all leaves.

    (Per leaf would divide by ~0 for gradients that vanish in exact arithmetic,
    such as the key bias, which a softmax over keys ignores.)
    """
    scale = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(a_tree))
    return max(float(jnp.max(jnp.abs(a - b)))
               for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree))) / scale


# Each code path of the sliced last layer: sequential and parallel residual, shared or
# separate parallel norms, learned / interleaved rotary / half rotary positions.
@pytest.mark.parametrize("variant", ["gpt2", "gptj", "gpt_neox", "gpt_neox_sequential", "llama"])
def test_output_slice_matches_the_full_forward(variant):
    config = _config(variant)
    params = jax.jit(transformer.init_params, static_argnums=0)(config, jax.random.PRNGKey(1))
    ids, mask = _inputs()
    lo, hi = SLICE

    def loss(p, output_slice):
        h = transformer.hidden_states(config, p, ids, mask, output_slice=output_slice)
        if output_slice is None:
            h = h[:, lo:hi]
        return jnp.sum(jnp.sin(h) * jnp.arange(h.shape[1])[None, :, None])

    @jax.jit  # one compilation for everything (op-by-op execution is slow)
    def both(p):
        full = transformer.forward(config, p, ids, mask)
        part = transformer.forward(config, p, ids, mask, output_slice=SLICE)
        return (full[0][:, lo:hi], part[0], full[1][:, lo:hi], part[1],
                jax.grad(loss)(p, None), jax.grad(loss)(p, SLICE))

    hidden_full, hidden_part, logits_full, logits_part, grads_full, grads_part = both(params)
    assert hidden_part.shape == (BATCH, hi - lo, config.d_model)
    np.testing.assert_allclose(hidden_part, hidden_full, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(logits_part, logits_full, atol=2e-5, rtol=1e-5)
    assert _max_rel_err(grads_full, grads_part) < 1e-5


@pytest.mark.parametrize("remat_policy,unroll", [("full", 1), ("dots_saveable", 2),
                                                  ("none", 2)])
def test_remat_and_unroll_do_not_change_values_or_gradients(remat_policy, unroll):
    base = _config("llama")
    other = base.replace(remat_policy=remat_policy, scan_unroll=unroll)
    params = jax.jit(transformer.init_params, static_argnums=0)(base, jax.random.PRNGKey(1))
    ids, mask = _inputs()

    def loss(config, p):
        return jnp.sum(jnp.sin(transformer.hidden_states(config, p, ids, mask,
                                                          output_slice=SLICE)))

    v_base, g_base = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(base, params)
    v_other, g_other = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(other, params)
    np.testing.assert_allclose(v_other, v_base, rtol=1e-6)
    assert _max_rel_err(g_base, g_other) < 1e-5


def test_unknown_remat_policy_is_a_clear_error():
    config = _config("gpt2", remat_policy="save_everything_please")
    with pytest.raises(ValueError, match="unknown remat_policy"):
        transformer.init_params(config, jax.random.PRNGKey(0))


def test_output_slice_is_validated():
    config = _config("gpt2")
    params = transformer.init_params(config, jax.random.PRNGKey(1))
    ids, mask = _inputs()
    for bad in [(5, 5), (-1, 4), (3, SEQ + 1), (7, 2)]:
        with pytest.raises(ValueError, match="output_slice"):
            transformer.hidden_states(config, params, ids, mask, output_slice=bad)
    cache = transformer.init_kv_cache(config, BATCH, SEQ)
    with pytest.raises(ValueError, match="output_slice"):
        transformer.forward(config, params, ids, mask, cache=cache, cache_mask=mask,
                            output_slice=SLICE)


def _xla_flops(fn, *args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    if not cost or "flops" not in cost:
        pytest.skip("backend gives no cost analysis")
    return cost["flops"]


def test_sliced_forward_flops_match_xla_cost_analysis():
    # Fully unrolled, so the cost analysis sees every layer (it counts a loop body once).
    config = ModelConfig.from_hf_dict(dict(
        model_type="gpt2", vocab_size=512, n_embd=128, n_layer=3, n_head=4,
        n_positions=128)).replace(scan_unroll=3)
    params = transformer.param_shapes(config)
    batch, query, response = 2, 48, 16
    seq = query + response
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, seq), jnp.bool_)

    def xla(output_slice):
        return _xla_flops(lambda p, i, m: transformer.hidden_states(
            config, p, i, m, output_slice=output_slice), params, ids, mask)

    full, part = xla(None), xla((query - 1, seq - 1))
    ours_full = batch * flops.forward_flops(config, seq, seq, 0)
    ours_part = batch * flops.forward_flops(config, seq, seq, 0, last_layer_tokens=response)
    # XLA also counts norms, softmax and activations (a few percent).
    assert ours_full == pytest.approx(full, rel=0.05)
    assert ours_part == pytest.approx(part, rel=0.05)
    assert ours_full - ours_part == pytest.approx(full - part, rel=0.05)
    assert part < 0.85 * full


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_per_layer_cache_matches_the_stacked_cache(variant):
    """Prefill then two one-token steps: the per-layer layout (unrolled layers that write
    their own buffer before reading it) gives the stacked layout's hidden states and
    cache contents, and the uncached forward's hidden states."""
    config = _config(variant)
    params = transformer.init_params(config, jax.random.PRNGKey(1))
    ids, mask = _inputs()
    prompt, total = SEQ - 2, SEQ
    cache_mask = jnp.concatenate([mask[:, :prompt], jnp.ones((BATCH, 2), bool)], axis=1)
    positions = transformer.position_ids_from_mask(mask)

    def run(per_layer):
        @jax.jit
        def steps(params, ids):
            cache = transformer.init_kv_cache(config, BATCH, total, per_layer=per_layer)
            hs = []
            for start, stop in ((0, prompt), (prompt, prompt + 1), (prompt + 1, total)):
                h, _, cache = transformer.forward(
                    config, params, ids[:, start:stop], mask[:, start:stop],
                    positions=positions[:, start:stop], cache=cache, cache_index=start,
                    cache_mask=cache_mask, with_head=False)
                hs.append(h)
            return jnp.concatenate(hs, axis=1), cache
        return steps(params, ids)

    stacked_h, stacked = run(False)
    layered_h, layered = run(True)
    assert layered.per_layer and not stacked.per_layer
    assert len(layered.k) == config.n_layers and layered.k[0].shape == stacked.k.shape[1:]
    real = np.asarray(mask)  # padding positions' outputs are never read
    np.testing.assert_allclose(np.asarray(layered_h)[real], np.asarray(stacked_h)[real],
                               rtol=1e-5, atol=1e-5)
    slots = np.asarray(cache_mask)[None, :, None, :, None]  # [L, B, KV, S, hd]
    for got, want in ((layered.k, stacked.k), (layered.v, stacked.v)):
        np.testing.assert_allclose(np.where(slots, np.stack(got), 0),
                                   np.where(slots, np.asarray(want), 0), rtol=1e-5, atol=1e-6)
    full = transformer.hidden_states(config, params, ids, mask)
    np.testing.assert_allclose(np.asarray(layered_h)[real], np.asarray(full)[real], rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("group", [1, 3])
def test_prefix_cache_matches_the_uncached_forward(variant, group):
    """Groups of `group` rows share a prompt's entries (PrefixKVCache) and each row then
    feeds two tokens of its own, one per step: every row's hidden states equal the
    uncached forward of its prompt followed by its own tokens (llama: grouped-query
    attention, 4 heads over 2 kv heads)."""
    config = _config(variant)
    params = transformer.init_params(config, jax.random.PRNGKey(1))
    ids, mask = _inputs()  # BATCH prompts (left padded) ...
    prompt = SEQ - 2
    prompt_ids, prompt_mask = ids[:, :prompt], mask[:, :prompt]
    rows = BATCH * group  # ... each followed by `group` different two-token continuations
    own_ids = jax.random.randint(jax.random.PRNGKey(5), (rows, 2), 0, tiny_hf.VOCAB - 1)
    full_ids = jnp.concatenate([jnp.repeat(prompt_ids, group, 0), own_ids], axis=1)
    full_mask = jnp.concatenate([jnp.repeat(prompt_mask, group, 0),
                                 jnp.ones((rows, 2), bool)], axis=1)
    positions = transformer.position_ids_from_mask(full_mask)

    @jax.jit
    def steps(params):
        stacked = transformer.init_kv_cache(config, BATCH, prompt)
        _, _, stacked = transformer.forward(config, params, prompt_ids, prompt_mask,
                                            cache=stacked, cache_mask=prompt_mask,
                                            with_head=False)
        own = transformer.init_kv_cache(config, rows, 2, per_layer=True)
        cache = transformer.PrefixKVCache(tuple(stacked.k), tuple(stacked.v), own.k, own.v)
        hs = []
        for step in range(2):
            h, _, cache = transformer.forward(
                config, params, own_ids[:, step:step + 1], jnp.ones((rows, 1), bool),
                positions=positions[:, prompt + step:prompt + step + 1], cache=cache,
                cache_index=step, cache_mask=prompt_mask, with_head=False)
            hs.append(h)
        return jnp.concatenate(hs, axis=1), cache

    got, cache = steps(params)
    assert isinstance(cache, transformer.PrefixKVCache)
    assert cache.prefix_k[0].shape == (BATCH, config.n_kv_heads, prompt, config.head_dim)
    assert cache.k[0].shape == (rows, config.n_kv_heads, 2, config.head_dim)
    full = transformer.hidden_states(config, params, full_ids, full_mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full)[:, prompt:], rtol=1e-4,
                               atol=1e-4)
    bad = transformer.PrefixKVCache(cache.prefix_k[:1] * config.n_layers,
                                    cache.prefix_v[:1] * config.n_layers, cache.k, cache.v)
    with pytest.raises(ValueError, match="input rows must equal the own buffers' rows"):
        transformer.forward(config, params, own_ids[:-1, :1], jnp.ones((rows - 1, 1), bool),
                            positions=positions[:-1, :1], cache=bad, cache_index=0,
                            cache_mask=prompt_mask, with_head=False)
    # Rows of a group differ (their own tokens do), so the prefix is not all that is read.
    if group > 1:
        assert float(jnp.max(jnp.abs(got[0] - got[1]))) > 1e-3
