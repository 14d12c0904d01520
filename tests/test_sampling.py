"""KV-cache sampler: parity with transformers and with the uncached forward, sampling
statistics, stop tokens, determinism, and equality on one device and on meshes."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tiny_hf
from pjit_ppo import sampling, sharding
from pjit_ppo.models import load_pretrained, lm_logits
from pjit_ppo.padding import truncate_after_stop

PAD = tiny_hf.PAD_ID
PROMPT_LENS = (7, 5, 1, 3, 6, 2, 7, 4)  # real tokens per row, left padded to 7


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """family -> (transformers model, checkpoint dir, our config, our params)."""
    cache = {}

    def get(family):
        if family not in cache:
            path = str(tmp_path_factory.mktemp(family))
            model = tiny_hf.save_model(family, path)
            config, params = load_pretrained(path)
            cache[family] = (model, path, config, params)
        return cache[family]

    return get


def _prompts(lens=PROMPT_LENS, seed=0):
    """Left-padded prompts: int32 [B, max(lens)] ids and bool mask."""
    rng = np.random.RandomState(seed)
    width = max(lens)
    ids = np.full((len(lens), width), PAD, np.int32)
    mask = np.zeros((len(lens), width), bool)
    for row, n in enumerate(lens):
        ids[row, width - n:] = rng.randint(2, PAD, n)
        mask[row, width - n:] = True
    return ids, mask


def _same_prompt(batch, seed=1):
    ids, mask = _prompts((5,), seed)
    return np.repeat(ids, batch, axis=0), np.repeat(mask, batch, axis=0)


#: (config, options) -> the jitted sampler `_gen` made for them: tests that draw again
#: with the same options (other keys, other prompts of the same shape) reuse its compiled
#: program instead of tracing it anew.
_SAMPLERS = {}


@pytest.fixture(scope="module", autouse=True)
def _forget_samplers():
    yield
    _SAMPLERS.clear()


def _gen(config, params, ids, mask, key=0, **options):
    fn_key = (config, tuple(sorted(options.items())))
    if fn_key not in _SAMPLERS:
        _SAMPLERS[fn_key] = jax.jit(
            lambda p, i, m, k: sampling.generate(config, p, i, m, k, **options))
    fn = _SAMPLERS[fn_key]
    return jax.tree_util.tree_map(np.asarray, fn(params, jnp.asarray(ids), jnp.asarray(mask),
                                                 jax.random.PRNGKey(key)))


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ------------------------------------------------------------------ parity
@pytest.mark.parametrize("family", tiny_hf.FAMILIES)
def test_greedy_matches_transformers(tiny_model, family):
    """Greedy tokens and every step's logits equal HF generate on left-padded prompts.

    HF builds position ids from the attention mask (cumsum - 1) in generate for
    all four families, which is what we do, so padding does not shift positions.
    """
    model, _, config, params = tiny_model(family)
    ids, mask = _prompts()
    n_new = 10
    tokens, logprobs, logits = _gen(config, params, ids, mask, max_new_tokens=n_new,
                                    greedy=True, return_logits=True)
    # With an EOS id, min_new_tokens makes HF mask EOS out of its argmax (a
    # generation_config passed to generate gets None fields refilled from the
    # model's). Without one HF neither masks nor stops: our default, where EOS is
    # just another token.
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor(ids, dtype=torch.long),
                                 attention_mask=torch.tensor(mask, dtype=torch.long),
                                 do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                                 pad_token_id=PAD, output_logits=True,
                                 return_dict_in_generate=True)
    finally:
        model.generation_config.eos_token_id = saved_eos
    hf_tokens = out.sequences[:, ids.shape[1]:].numpy()
    hf_logits = torch.stack(out.logits, dim=1).float().numpy()  # raw, before processors
    np.testing.assert_array_equal(tokens, hf_tokens)
    np.testing.assert_allclose(logits, hf_logits, atol=1e-4, rtol=1e-4)
    # greedy logprobs are still log_softmax(logits / temperature) at the chosen token
    expected = np.take_along_axis(_log_softmax(logits), tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(logprobs, expected, atol=1e-5)


@pytest.mark.parametrize("family", tiny_hf.FAMILIES)
def test_cached_logits_equal_full_forward(tiny_model, family):
    """Per-step logits of the cached loop == one uncached forward over prompt + response."""
    _, _, config, params = tiny_model(family)
    ids, mask = _prompts()
    n_new = 9
    tokens, logprobs, logits = _gen(config, params, ids, mask, key=3, max_new_tokens=n_new,
                                    temperature=0.9, return_logits=True)
    full_ids = np.concatenate([ids, tokens], axis=1)
    full_mask = np.concatenate([mask, np.ones_like(tokens, bool)], axis=1)
    full = np.asarray(lm_logits(config, params, jnp.asarray(full_ids), jnp.asarray(full_mask)))
    p = ids.shape[1]
    np.testing.assert_allclose(logits, full[:, p - 1:p - 1 + n_new], atol=1e-4, rtol=0)
    # returned logprobs: temperature-scaled, unfiltered
    expected = np.take_along_axis(_log_softmax(full[:, p - 1:-1] / 0.9), tokens[..., None],
                                  -1)[..., 0]
    np.testing.assert_allclose(logprobs, expected, atol=1e-4)


# ------------------------------------------------------------------ statistics
def _chi2_threshold(df):
    """Upper 0.999 quantile of chi-square(df) by the Wilson-Hilferty cube approximation.

    (X/df)^(1/3) is close to normal with mean 1 - 2/(9 df) and variance 2/(9 df);
    z_0.999 = 3.0902. The relative error of this quantile is below 1% for
    df >= 3 (e.g. df=10: 29.53 vs the exact 29.59; df=50: 86.66 vs 86.66), and
    we add 5% slack on top, so the test only fails on a real discrepancy.
    """
    z = 3.0902
    a = 2.0 / (9.0 * df)
    return 1.05 * df * (1.0 - a + z * math.sqrt(a)) ** 3


def _chi2(counts, probs, min_expected=5.0):
    """Pearson statistic and degrees of freedom, pooling bins with expected < 5."""
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = list(counts[big]) + [counts[~big].sum()]
    exp = list(expected[big]) + [expected[~big].sum()]
    if exp[-1] < min_expected:  # fold a small pooled bin into the largest one
        i = int(np.argmax(exp[:-1]))
        obs[i] += obs.pop()
        exp[i] += exp.pop()
    obs, exp = np.asarray(obs, float), np.asarray(exp, float)
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


@pytest.mark.parametrize("options", [dict(temperature=1.0), dict(temperature=0.7),
                                     dict(temperature=1.3, top_k=12),
                                     dict(temperature=1.3, top_p=0.7),
                                     dict(temperature=1.3, top_k=20, top_p=0.8)],
                         ids=["t1", "t0.7", "topk", "topp", "topk_topp"])
def test_first_token_frequencies_match_softmax(tiny_model, options):
    """20000 draws of the first new token follow softmax(filtered logits / T) (chi-square)."""
    _, _, config, params = tiny_model("gpt_neox")
    n = 20000
    ids, mask = _same_prompt(n)
    tokens, logprobs, logits = _gen(config, params, ids, mask, key=11, max_new_tokens=1,
                                    return_logits=True, **options)
    scaled = logits[0, 0].astype(np.float64) / options["temperature"]
    keep = np.ones_like(scaled, bool)
    order = np.argsort(-scaled, kind="stable")
    if options.get("top_k"):
        keep[order[options["top_k"]:]] = False
    if options.get("top_p", 1.0) < 1.0:
        kept = order[keep[order]]
        p = np.exp(scaled[kept] - scaled[kept].max())
        p /= p.sum()
        before = np.cumsum(p) - p
        keep[kept[before >= options["top_p"]]] = False
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    counts = np.bincount(tokens[:, 0], minlength=config.vocab_size)
    assert counts[~keep].sum() == 0, "sampled a token outside the top-k / nucleus set"
    stat, df = _chi2(counts, probs)
    assert df >= 3, f"distribution too peaked for a useful test (df={df})"
    assert stat < _chi2_threshold(df), (stat, df)
    # the logprob is of the unfiltered tempered distribution
    np.testing.assert_allclose(logprobs[:, 0], _log_softmax(scaled)[tokens[:, 0]], atol=1e-5)


@pytest.mark.parametrize("options", [dict(top_k=5), dict(top_p=0.5), dict(top_k=8, top_p=0.6)])
def test_filters_never_emit_outside_the_kept_set(tiny_model, options):
    """At every step of a long sample, the token lies in that step's top-k / nucleus."""
    _, _, config, params = tiny_model("llama")
    ids, mask = _prompts()
    ids, mask = np.tile(ids, (8, 1)), np.tile(mask, (8, 1))
    tokens, _, logits = _gen(config, params, ids, mask, key=5, max_new_tokens=16,
                             temperature=2.0, return_logits=True, **options)
    scaled = logits / 2.0
    keep = np.isfinite(np.asarray(sampling.filter_logits(
        jnp.asarray(scaled.reshape(-1, scaled.shape[-1])), **options)))
    picked_ok = np.take_along_axis(keep, tokens.reshape(-1, 1), -1)
    assert picked_ok.all()
    # and the filter itself agrees with a NumPy reference
    flat = scaled.reshape(-1, scaled.shape[-1]).astype(np.float64)
    for row in range(0, flat.shape[0], 37):
        order = np.argsort(-flat[row], kind="stable")
        ref = np.ones(flat.shape[1], bool)
        if options.get("top_k"):
            ref[order[options["top_k"]:]] = False
        if options.get("top_p"):
            kept = order[ref[order]]
            p = np.exp(flat[row, kept] - flat[row, kept].max())
            p /= p.sum()
            ref[kept[(np.cumsum(p) - p) >= options["top_p"]]] = False
        np.testing.assert_array_equal(keep[row], ref)
    assert len(np.unique(tokens)) > 5  # it did sample


def test_tiny_temperature_equals_greedy(tiny_model):
    _, _, config, params = tiny_model("gpt2")
    ids, mask = _prompts()
    greedy = _gen(config, params, ids, mask, max_new_tokens=12, greedy=True)[0]
    cold = _gen(config, params, ids, mask, key=9, max_new_tokens=12, temperature=1e-6)[0]
    np.testing.assert_array_equal(cold, greedy)


# ------------------------------------------------------------------ stop token
def test_stop_token_pads_after_min_new_tokens(tiny_model):
    _, _, config, params = tiny_model("gpt2")
    ids, mask = _prompts()
    ids, mask = np.tile(ids, (4, 1)), np.tile(mask, (4, 1))
    n_new, min_new = 16, 4
    options = dict(max_new_tokens=n_new, temperature=1.5)
    raw, raw_lp = _gen(config, params, ids, mask, key=2, **options)
    # the most frequent token makes a stop token that occurs both early and late
    stop = int(np.bincount(raw.ravel()).argmax())
    early = (raw[:, :min_new] == stop).any(axis=1)
    late = (raw[:, min_new:] == stop).any(axis=1)
    assert early.any() and late.any() and (~late).any(), "test needs all kinds of rows"
    assert (early & late).any(), "need a row whose early stop token must not stop it"
    tokens, logprobs = _gen(config, params, ids, mask, key=2, stop_token=stop,
                            min_new_tokens=min_new, pad_token_id=PAD, **options)
    # Until its stop token a row is the unstopped sample (same keys, same inputs);
    # after it everything is pad with logprob 0: the reference truncation.
    expected, found = truncate_after_stop(jnp.asarray(raw), stop, min_new, PAD)
    np.testing.assert_array_equal(tokens, np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(found), late)
    after = np.asarray(expected) != raw
    np.testing.assert_array_equal(logprobs[after], 0.0)
    np.testing.assert_allclose(logprobs[~after], raw_lp[~after], atol=1e-6)
    # without min_new_tokens an early stop token stops the row
    t0, _ = _gen(config, params, ids, mask, key=2, stop_token=stop, pad_token_id=PAD, **options)
    np.testing.assert_array_equal(t0, np.asarray(truncate_after_stop(jnp.asarray(raw), stop, 0,
                                                                     PAD)[0]))


def test_default_ignores_eos(tiny_model):
    """Without stop_token exactly max_new_tokens are sampled, EOS included."""
    _, _, config, params = tiny_model("gpt2")
    ids, mask = _prompts()
    tokens, logprobs = _gen(config, params, ids, mask, key=4, max_new_tokens=20,
                            temperature=3.0)
    assert tokens.shape == (len(PROMPT_LENS), 20) and tokens.dtype == np.int32
    assert logprobs.dtype == np.float32 and (logprobs < 0).all()


def test_option_errors(tiny_model):
    _, _, config, params = tiny_model("gpt2")
    ids, mask = _prompts()
    k = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="pad_token_id"):
        sampling.generate(config, params, ids, mask, k, max_new_tokens=3, stop_token=1)
    with pytest.raises(ValueError, match="temperature"):
        sampling.generate(config, params, ids, mask, k, max_new_tokens=3, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling.generate(config, params, ids, mask, k, max_new_tokens=3, top_p=0.0)
    with pytest.raises(ValueError, match="max_positions"):
        sampling.generate(config, params, ids, mask, k, max_new_tokens=64)
    with pytest.raises(ValueError, match="static"):
        jax.jit(lambda t: sampling.generate(config, params, ids, mask, k, max_new_tokens=3,
                                            temperature=t))(0.5)


# ------------------------------------------------------------------ randomness
def test_keys_and_rows(tiny_model):
    _, _, config, params = tiny_model("llama")
    ids, mask = _same_prompt(16)
    a = _gen(config, params, ids, mask, key=1, max_new_tokens=12)
    b = _gen(config, params, ids, mask, key=1, max_new_tokens=12)
    c = _gen(config, params, ids, mask, key=2, max_new_tokens=12)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert (a[0] != c[0]).any()
    # identical prompts in every row still give different samples
    assert len({tuple(row) for row in a[0]}) == len(a[0])


# ------------------------------------------------------------------ meshes
MESHES = {"fsdp4_tensor2": dict(fsdp=4, tensor=2), "data8": dict(data=8, fsdp=1)}
OPTIONS = dict(max_new_tokens=8, temperature=0.7, top_p=0.9)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_same_samples_on_one_device_and_on_a_mesh(tiny_model, family, mesh_name):
    # Sharding-invariant random bits need the partitionable threefry (jax >= 0.5 default).
    assert jax.config.jax_threefry_partitionable
    _, path, config, params = tiny_model(family)
    ids, mask = _prompts()
    single = _gen(config, params, ids, mask, key=7, **OPTIONS)
    mesh = sharding.make_mesh(**MESHES[mesh_name])
    _, sharded = load_pretrained(path, mesh=mesh)
    fn = sampling.make_generate_fn(config, mesh, **OPTIONS)
    tokens, logprobs = fn(sharded, jnp.asarray(ids), jnp.asarray(mask), jax.random.PRNGKey(7))
    assert tokens.sharding.spec == sharding.batch_sharding(mesh).spec
    np.testing.assert_array_equal(np.asarray(tokens), single[0])
    np.testing.assert_allclose(np.asarray(logprobs), single[1], atol=1e-5)

    # traced inside a larger jit (as in the rollout), with the cache constraints on
    @jax.jit
    def rollout(p, i, m, k):
        t, lp = sampling.generate(config, p, i, m, k, mesh=mesh, **OPTIONS)
        return t, lp.sum(axis=1)

    batch = jax.device_put(jnp.asarray(ids), sharding.batch_sharding(mesh))
    bmask = jax.device_put(jnp.asarray(mask), sharding.batch_sharding(mesh))
    t2, total = rollout(sharded, batch, bmask, jax.random.PRNGKey(7))
    np.testing.assert_array_equal(np.asarray(t2), single[0])
    np.testing.assert_allclose(np.asarray(total), single[1].sum(1), atol=1e-4)


def test_cache_is_sharded_on_the_mesh(tiny_model):
    """The compiled sampler keeps the KV cache batch-sharded and kv-head-sharded."""
    _, path, config, _ = tiny_model("llama")
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    _, sharded = load_pretrained(path, mesh=mesh)
    ids, mask = _prompts()
    fn = sampling.make_generate_fn(config, mesh, max_new_tokens=3)
    compiled = fn.lower(sharded, jnp.asarray(ids), jnp.asarray(mask),
                        jax.random.PRNGKey(0)).compile().as_text()
    # The decode loop carries, per layer, the prompt entries [batch, kv_heads, prompt,
    # head_dim] = [8, 2, 7, 8] and the generated tokens' [8, 2, 2, 8]; batch over fsdp
    # (4) and kv heads over tensor (2) leave [2, 1, 7, 8] and [2, 1, 2, 8] per device.
    # (Without the constraint XLA keeps the batch whole: [8, 1, ., 8].)
    carried = [re.findall(r"f32\[[28],[12],[72],8\]", line.split(" while(")[0])
               for line in compiled.splitlines() if " while(" in line]
    decode = [shapes for shapes in carried if "f32[2,1,2,8]" in shapes]
    assert len(decode) == 1, carried
    n_layers = config.n_layers
    want = ["f32[2,1,2,8]"] * 2 * n_layers + ["f32[2,1,7,8]"] * 2 * n_layers
    assert sorted(decode[0]) == want, decode


def test_head_only_on_the_last_prompt_position(tiny_model):
    """The compiled sampler never materialises [B, P, V] logits, only [B, V] per step."""
    _, _, config, params = tiny_model("gpt2")
    ids, mask = _prompts()
    fn = sampling.make_generate_fn(config, max_new_tokens=4)
    compiled = fn.lower(params, jnp.asarray(ids), jnp.asarray(mask),
                        jax.random.PRNGKey(0)).compile().as_text()
    b, p, v = ids.shape + (config.vocab_size,)
    assert f"f32[{b},{p},{v}]" not in compiled and f"f32[{b},{p + 4},{v}]" not in compiled
    assert f"f32[{b},{v}]" in compiled


@pytest.mark.parametrize("top_p,mode,kept", [
    (0.7, "transformers", 2),           # the token whose mass crosses 0.7 (0.3) is kept
    (0.7, "lm_human_preferences", 1),   # only tokens with running total <= 0.7
    (0.8, "lm_human_preferences", 2),   # 0.5 + 0.3 = 0.8 <= 0.8
    (0.3, "lm_human_preferences", 1),   # never fewer than the most likely token
    (0.96, "transformers", 4),
])
def test_top_p_conventions(top_p, mode, kept):
    probs = np.array([[0.05, 0.5, 0.15, 0.3]])
    scaled = jnp.log(jnp.asarray(probs, jnp.float32))
    filtered = np.asarray(sampling.filter_logits(scaled, top_p=top_p, top_p_mode=mode))
    order = np.argsort(-probs[0])
    assert np.isfinite(filtered[0, order[:kept]]).all()
    assert np.isneginf(filtered[0, order[kept:]]).all()


def _grouped_prompts(groups=4, g=3):
    """Each of `groups` prompts repeated g times in contiguous rows."""
    ids, mask = _prompts(PROMPT_LENS[:groups])
    return np.repeat(ids, g, axis=0), np.repeat(mask, g, axis=0)


def test_one_prefill_per_prompt_samples_as_prefilling_every_row(tiny_model):
    """samples_per_prompt=G prefills the first row of each group and copies its cache:
    the same tokens and log-probs as prefilling every row, and the other rows'
    prompt ids are not read."""
    _, _, config, params = tiny_model("gpt2")
    ids, mask = _grouped_prompts()
    every_row = _gen(config, params, ids, mask, key=3, max_new_tokens=6, temperature=0.8)
    shared = _gen(config, params, ids, mask, key=3, max_new_tokens=6, temperature=0.8,
                  samples_per_prompt=3)
    np.testing.assert_array_equal(shared[0], every_row[0])
    np.testing.assert_allclose(shared[1], every_row[1], rtol=1e-5, atol=1e-5)
    scrambled = ids.copy()
    scrambled.reshape(4, 3, -1)[:, 1:] = 7  # rows 1.. of each group: never read
    again = _gen(config, params, scrambled, mask, key=3, max_new_tokens=6, temperature=0.8,
                 samples_per_prompt=3)
    np.testing.assert_array_equal(again[0], shared[0])
    np.testing.assert_array_equal(again[1], shared[1])
    # The group's samples differ from each other (each row draws its own numbers).
    assert len({tuple(r) for r in shared[0][:3]}) > 1
    with pytest.raises(ValueError, match="samples_per_prompt=5 must be a positive divisor"):
        _gen(config, params, ids, mask, max_new_tokens=2, samples_per_prompt=5)


def test_one_prefill_per_prompt_on_a_mesh(tiny_model):
    """On a mesh: groups split evenly over the batch devices share a prefill; when
    B / G prompts do not split evenly, every row is prefilled. Both sample what one
    device samples."""
    _, path, config, _ = tiny_model("llama")
    ids, mask = _grouped_prompts(groups=4, g=2)  # 8 rows, 4 prompts
    _, params = load_pretrained(path)
    single = _gen(config, params, ids, mask, key=5, max_new_tokens=4, samples_per_prompt=2)
    for fsdp, tensor in ((4, 2), (8, 1)):  # 4 prompts over 4 devices: shared; 8: every row
        mesh = sharding.make_mesh(fsdp=fsdp, tensor=tensor)
        _, sharded = load_pretrained(path, mesh=mesh)
        fn = sampling.make_generate_fn(config, mesh, max_new_tokens=4, samples_per_prompt=2)
        tokens, logprobs = fn(sharded, jnp.asarray(ids), jnp.asarray(mask),
                              jax.random.PRNGKey(5))
        np.testing.assert_array_equal(np.asarray(tokens), single[0])
        np.testing.assert_allclose(np.asarray(logprobs), single[1], rtol=1e-5, atol=1e-5)
    assert sampling._prefill_group(8, 2, sharding.make_mesh(fsdp=4, tensor=2),
                                   sharding.DEFAULT_AXIS_RULES) == 2
    assert sampling._prefill_group(8, 2, sharding.make_mesh(fsdp=8),
                                   sharding.DEFAULT_AXIS_RULES) == 1


def test_padded_logits_sample_like_the_vocabulary():
    """Logits padded to a multiple of the block (as the sampler's LM head pads them) draw
    the same tokens with the same log-probs, whatever the padding holds."""
    vocab, block = 1000, 256  # 4 blocks, the last with 24 real tokens
    logits = jax.random.normal(jax.random.PRNGKey(0), (64, vocab)) * 3.0
    for pad_value in (0.0, 50.0, -50.0):
        padded = jnp.pad(logits, ((0, 0), (0, 1024 - vocab)), constant_values=pad_value)
        for key in range(3):
            k = jax.random.PRNGKey(key)
            want = sampling.sample_from_logits(logits, k, temperature=0.7, block_size=block)
            got = sampling.sample_from_logits(padded, k, temperature=0.7, block_size=block,
                                              vocab_size=vocab)
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
            np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6,
                                       atol=1e-6)
            assert int(jnp.max(got[0])) < vocab
    # Tokens in the short last block are drawn too.
    last = jnp.full((4, vocab), -30.0).at[:, vocab - 3].set(10.0)
    padded = jnp.pad(last, ((0, 0), (0, 24)), constant_values=20.0)
    tokens, _ = sampling.sample_from_logits(padded, jax.random.PRNGKey(1), block_size=block,
                                            vocab_size=vocab)
    np.testing.assert_array_equal(np.asarray(tokens), vocab - 3)
    with pytest.raises(ValueError, match="logits have 1010 columns"):
        sampling.sample_from_logits(jnp.zeros((2, 1010)), jax.random.PRNGKey(0),
                                    block_size=block, vocab_size=vocab)


def test_block_divides_the_vocabulary_when_it_can():
    """generate's block is a divisor of the vocabulary where one lies in [256, 2048] (no
    padded LM head), else 256 with padding; both blocks draw the same tokens."""
    assert sampling.block_size_for_vocab(50257) == 1733  # 29 x 1733: GPT-2
    assert sampling.block_size_for_vocab(50400) == 280   # GPT-J
    assert sampling.block_size_for_vocab(32000) == 256
    assert sampling.block_size_for_vocab(300) == 300     # one block
    assert sampling.block_size_for_vocab(100) == 256     # smaller than a block: padded
    assert sampling.block_size_for_vocab(4099) == 256    # a prime above 2048: padded
    vocab = 3 * 521
    block = sampling.block_size_for_vocab(vocab)
    assert block == 521
    logits = jax.random.normal(jax.random.PRNGKey(0), (64, vocab)) * 3.0
    for key in range(4):
        k = jax.random.PRNGKey(key)
        want = sampling.sample_from_logits(logits, k, temperature=0.7, block_size=256)
        got = sampling.sample_from_logits(logits, k, temperature=0.7, block_size=block)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6,
                                   atol=1e-6)


def _loop_body_lines(hlo: str, carried_shape: str) -> list:
    """The lines of the while loop whose carried tuple holds `carried_shape`, and of every
    computation its body calls (fusions, nested loops), from compiled HLO text."""
    computations, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if header:
            name = header.group(1)
            computations[name] = []
        elif name is not None:
            computations[name].append(line)
    loops = [line for line in hlo.splitlines()
             if " while(" in line and carried_shape in line.split(" while(")[0]]
    assert len(loops) == 1, loops
    todo, seen, lines = [re.search(r"body=%([\w.\-]+)", loops[0]).group(1)], set(), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in computations[name]:
            lines.append(line)
            todo += re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", line)
    return lines


@pytest.mark.parametrize("samples_per_prompt", [1, 2])
def test_decode_loop_does_not_copy_the_cache(tiny_model, samples_per_prompt):
    """Each layer's buffer of generated tokens is updated in place in the decode loop,
    and the prompt entries are read where they are: no step copies either (on CPU,
    copying the cache every step cost more than the rest of a one-token step). With
    G = 2 the prompt entries exist once per prompt, never per row."""
    _, _, config, params = tiny_model("gpt2")
    ids, mask = _prompts()
    g = samples_per_prompt
    fn = sampling.make_generate_fn(config, max_new_tokens=4, samples_per_prompt=g)
    compiled = fn.lower(params, jnp.asarray(ids), jnp.asarray(mask),
                        jax.random.PRNGKey(0)).compile().as_text()
    b, p, kv, hd = ids.shape + (config.n_kv_heads, config.head_dim)
    own, prefix = f"f32[{b},{kv},3,{hd}]", f"f32[{b // g},{kv},{p},{hd}]"
    body = _loop_body_lines(compiled, own)
    assert body and own in "\n".join(body) and prefix in "\n".join(body)
    if g > 1:
        assert f"f32[{b},{kv},{p},{hd}]" not in compiled
    copies = [line for line in body for shape in (own, prefix)
              if re.search(r"= " + re.escape(shape) + r"\{[^}]*\} copy\(", line)]
    assert not copies, copies
