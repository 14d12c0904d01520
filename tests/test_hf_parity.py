"""Our decoder on imported HF weights vs transformers, per family, on 1 device and a 4x2 mesh.

Tiny random models (tests/tiny_hf.py) with large-std weights so that any
layout or math difference shows in the logits.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tiny_hf
from pjit_ppo import sharding
from pjit_ppo.models import forward, init_kv_cache, lm_logits, load_pretrained
from pjit_ppo.padding import position_ids_from_mask

# variant -> (family, HF config overrides)
VARIANTS = tiny_hf.VARIANTS
ATOL = 1e-4


def _batch(padded, batch=3, length=8, seed=0):
    """ids int32 [B, T], mask bool [B, T]; with padding, rows 1 and 2 are left-padded."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(2, tiny_hf.PAD_ID, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), bool)
    if padded:
        mask[1, :3] = False
        mask[2, :1] = False
        ids[~mask] = tiny_hf.PAD_ID
    return ids, mask


def _hf_logits(model, ids, mask):
    """transformers logits with left padding handled via position_ids (cumsum - 1, >= 0)."""
    m = torch.tensor(mask.astype(np.int64))
    position_ids = (m.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids.astype(np.int64)), attention_mask=m,
                    position_ids=position_ids)
    return out.logits.float().numpy()


@pytest.mark.parametrize("on_mesh", [False, True], ids=["1dev", "mesh4x2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tiny, variant, on_mesh):
    path, model = tiny(variant)
    mesh = sharding.make_mesh(fsdp=4, tensor=2) if on_mesh else None
    config, params = load_pretrained(path, mesh=mesh)
    if variant == "llama_tied":
        assert config.tie_word_embeddings and "lm_head" not in params
    if variant == "llama_bias":
        assert {"b"} <= set(params["transformer/layers/attn/o"]) & set(
            params["transformer/layers/mlp/fc_gate"])
    fn = jax.jit(functools.partial(lm_logits, config))
    for padded in (False, True):
        ids, mask = _batch(padded)
        ours = np.asarray(fn(params, jnp.asarray(ids), jnp.asarray(mask)))
        assert ours.dtype == np.float32 and ours.shape == ids.shape + (config.vocab_size,)
        ref = _hf_logits(model, ids, mask)
        err = np.abs(ours - ref)[mask].max()
        assert err <= ATOL, f"{variant} padded={padded}: max abs diff {err}"


@pytest.mark.parametrize("variant", ["gpt2", "gptj", "gpt_neox", "llama"])
def test_kv_cache_decoding_matches_full_forward(tiny, variant):
    """Prefill a left-padded prompt into the cache, then feed tokens one at a time."""
    path, _ = tiny(variant)
    config, params = load_pretrained(path)
    n_new = 4
    prompt, prompt_mask = _batch(True, batch=3, length=6, seed=1)
    new = np.random.RandomState(2).randint(2, tiny_hf.PAD_ID, (3, n_new)).astype(np.int32)
    ids = np.concatenate([prompt, new], 1)
    mask = np.concatenate([prompt_mask, np.ones_like(new, bool)], 1)
    full = np.asarray(jax.jit(functools.partial(lm_logits, config))(params, ids, mask))

    p, total = prompt.shape[1], ids.shape[1]
    cache = init_kv_cache(config, batch=3, max_len=total)
    cache_mask = np.zeros((3, total), bool)
    cache_mask[:, :p] = prompt_mask
    prefill = jax.jit(lambda params, ids, mask, cache, cache_mask: forward(
        config, params, ids, mask, cache=cache, cache_index=0, cache_mask=cache_mask,
        positions=position_ids_from_mask(mask)))
    _, logits, cache = prefill(params, prompt, prompt_mask, cache, cache_mask)
    err = np.abs(np.asarray(logits) - full[:, :p])[prompt_mask].max()
    assert err <= ATOL, f"prefill: max abs diff {err}"

    @jax.jit
    def step(params, token, cache, index, cache_mask, positions):
        return forward(config, params, token, jnp.ones_like(token, bool), positions=positions,
                       cache=cache, cache_index=index, cache_mask=cache_mask)[1:]

    n_real = prompt_mask.sum(1)
    for t in range(n_new):
        cache_mask[:, p + t] = True
        positions = (n_real + t)[:, None].astype(np.int32)
        logits, cache = step(params, new[:, t:t + 1], cache, p + t, cache_mask, positions)
        err = np.abs(np.asarray(logits)[:, 0] - full[:, p + t]).max()
        assert err <= ATOL, f"decode step {t}: max abs diff {err}"
