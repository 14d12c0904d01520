"""KV-cache sampler for left-padded prompts.

`generate` runs one prefill of the prompt into a preallocated KV cache, then a
`lax.scan` over the new tokens that feeds one token per step; nothing leaves the
device and every Python-level option is static, so it traces inside a larger
jit (the PPO rollout) and compiles once per shape.

Log-probabilities. `generate` returns, for every sampled token, its log-prob
under ``log_softmax(logits / temperature)``: the temperature-scaled but
*unfiltered* distribution (no top-k / top-p truncation). This is what the
reference (lm-human-preferences) uses in every training logprob computation,
so rollout logprobs match the ones the PPO loss recomputes. With `greedy` the
temperature does not change which token is picked, but the logprob is still
taken under ``logits / temperature`` for the same reason.

Random numbers. Step `i` (the i-th new token) uses ``fold_in(key, i)``. A
token is drawn by inverse-CDF sampling: one uniform per row against the
cumulative (filtered) probabilities, searched in two levels (blocks of
`block_size` tokens, then a token within the block). That is exact, needs B
random numbers per step instead of the B x V of Gumbel-max sampling (which
dominates a CPU step for a 50k vocabulary), and, with jax's partitionable
threefry (on by default in jax 0.10), draws the same numbers on one device and
on any mesh. Logits are gathered along the vocabulary before the search so
that its rounding does not depend on the mesh either.

Cost per step: the LM head on [B, D] (logits [B, V], never [B, T, V]), a few
O(V) passes over [B, V] for sampling, and the transformer on one token per row
against the cache. Top-p without top-k sorts the vocabulary each step (top-k
uses `lax.top_k`, and top-p after top-k only sorts the k survivors).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pjit_ppo import sharding
from pjit_ppo.config import SamplingOptions
from pjit_ppo.models.config import ModelConfig
from pjit_ppo.models.transformer import (KVCache, forward, init_kv_cache, lm_head_logits,
                                         param_shapes)
from pjit_ppo.padding import position_ids_from_mask

__all__ = ["SamplingOptions", "generate", "make_generate_fn", "sample_from_logits",
           "filter_logits", "keep_threshold"]

# Logical axes of the KV cache [n_layers, batch, n_kv_heads, max_len, head_dim].
CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


# ------------------------------------------------------------------ one step
def keep_threshold(scaled: jax.Array, top_k: int = 0, top_p: float = 1.0,
                   top_p_mode: str = "transformers") -> Optional[jax.Array]:
    """Per-row logit threshold of the top-k / nucleus filter, or None when both are off.

    Args:
      scaled: float32 [B, V], temperature-scaled logits.
      top_k: keep the k largest per row (0 or >= V = off). Ties with the k-th
        value are kept.
      top_p: nucleus threshold (1.0 = off); computed on the top-k distribution
        when top_k is on (HF's order), else on a full sort of the vocabulary.
      top_p_mode: "transformers" keeps the most likely tokens whose probabilities
        before them sum to less than top_p (the token crossing top_p is kept);
        "lm_human_preferences" keeps those whose running total including
        themselves is <= top_p (at least one).

    Returns:
      None, or float32 [B, 1]: a token is kept iff its scaled logit >= threshold
      (at least the row's best token always is).
    """
    vocab = scaled.shape[-1]
    k = top_k if 0 < top_k < vocab else 0
    if k == 0 and top_p >= 1.0:
        return None
    if k:
        top_values = jax.lax.top_k(scaled, k)[0]  # [B, k], descending
    else:
        top_values = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)  # [B, V], descending
    if top_p >= 1.0:
        return top_values[:, -1:]
    probs = jax.nn.softmax(top_values, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    if top_p_mode == "transformers":
        n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # >= 1
    elif top_p_mode == "lm_human_preferences":
        n_keep = jnp.maximum(jnp.sum(mass_before + probs <= top_p, axis=-1, keepdims=True), 1)
    else:
        raise ValueError(f"top_p_mode={top_p_mode!r}; choose 'transformers' or "
                         f"'lm_human_preferences'")
    return jnp.take_along_axis(top_values, n_keep - 1, axis=-1)


def filter_logits(scaled: jax.Array, top_k: int = 0, top_p: float = 1.0,
                  top_p_mode: str = "transformers") -> jax.Array:
    """`scaled` [B, V] with logits outside the top-k / nucleus set to -inf (float32 [B, V])."""
    threshold = keep_threshold(scaled, top_k, top_p, top_p_mode)
    return scaled if threshold is None else jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _search(cdf: jax.Array, u: jax.Array, weights: jax.Array) -> jax.Array:
    """First index whose cdf exceeds u, clamped to the last index of positive weight.

    cdf, weights: [B, n] (cdf = cumsum(weights)); u: [B, 1]. Returns int32 [B].
    Zero-weight entries have empty intervals, so they are never picked; the
    clamp only matters when rounding pushes u onto the total.
    """
    idx = jnp.sum(cdf <= u, axis=-1, dtype=jnp.int32)
    last = weights.shape[-1] - 1 - jnp.argmax(jnp.flip(weights > 0, axis=-1), axis=-1)
    return jnp.minimum(idx, last.astype(jnp.int32))


def _inverse_cdf_sample(scaled, top, threshold, key, block: int, rows=None):
    """Draws a token with probability proportional to exp(scaled - top) where kept.

    Two-level inverse CDF: one uniform per row picks a block of `block` tokens
    from the cumulative block sums, then a token inside the block, whose
    weights are recomputed from a gathered [B, block] slice of the logits.
    Exact like a flat cumsum over V, but a [B, 50k] cumsum (and a gather from
    a fused [B, V] expression) is several times slower on CPU than the
    reductions used here.

    Args:
      scaled: float32 [B, V]; top: float32 [B, 1], the row max of scaled;
      threshold: None or float32 [B, 1] (tokens below it get weight 0);
      key: PRNG key; block: block size.
      rows: None, or (row_ids int32 [B], total_rows): these B rows are rows `row_ids`
        of a batch of total_rows, and draw exactly what they would draw there.

    Returns:
      (tokens int32 [B], scaled logit of each token float32 [B],
       total kept weight sum(exp(scaled - top)) float32 [B]).
    """
    batch, vocab = scaled.shape
    n_blocks = -(-vocab // block)
    padded = jnp.pad(scaled, ((0, 0), (0, n_blocks * block - vocab)), constant_values=-jnp.inf)

    def weight(x):
        w = jnp.exp(x - top)
        return w if threshold is None else jnp.where(x >= threshold, w, 0.0)

    block_sums = jnp.sum(weight(padded).reshape(batch, n_blocks, block), axis=-1)  # [B, nb]
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    total = block_cdf[:, -1:]
    if rows is None:
        u = jax.random.uniform(key, (batch, 1), jnp.float32)
    else:
        u = jnp.take(jax.random.uniform(key, (rows[1], 1), jnp.float32), rows[0], axis=0)
    u = u * total
    b = _search(block_cdf, u, block_sums)  # [B]
    below = jnp.take_along_axis(block_cdf - block_sums, b[:, None], axis=-1)  # mass before b
    xs = jnp.take_along_axis(padded.reshape(batch, n_blocks, block), b[:, None, None],
                             axis=1)[:, 0]  # [B, block]
    inner = weight(xs)
    i = _search(jnp.cumsum(inner, axis=-1), jnp.maximum(u - below, 0.0), inner)
    picked = jnp.take_along_axis(xs, i[:, None], axis=-1)[:, 0]
    return b * block + i, picked, total[:, 0]


def sample_from_logits(logits: jax.Array, key: jax.Array, *, temperature: float = 1.0,
                       top_k: int = 0, top_p: float = 1.0, top_p_mode: str = "transformers",
                       greedy: bool = False, block_size: int = 256, rows=None):
    """Draws one token per row and returns its unfiltered, temperature-scaled logprob.

    Args:
      logits: float [B, V] raw next-token logits.
      key: PRNG key for this step (unused when greedy).
      temperature, top_k, top_p, top_p_mode, greedy: as in SamplingOptions.
      block_size: block length of the two-level inverse-CDF search (speed only).
      rows: None, or (row_ids int32 [B], total_rows): the draws these rows get as rows
        `row_ids` of a batch of total_rows (a micro-batch samples like the whole batch).

    Returns:
      (tokens int32 [B], logprobs float32 [B]) with logprobs from
      log_softmax(logits / temperature) (no top-k / top-p filtering).
    """
    scaled = logits.astype(jnp.float32) / temperature
    top = jnp.max(scaled, axis=-1, keepdims=True)  # [B, 1]
    if greedy:
        tokens = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
        picked, threshold, total = top[:, 0], None, None
    else:
        threshold = keep_threshold(scaled, top_k, top_p, top_p_mode)
        tokens, picked, total = _inverse_cdf_sample(scaled, top, threshold, key, block_size,
                                                    rows)
    if threshold is not None or total is None:  # need the unfiltered normaliser
        total = jnp.sum(jnp.exp(scaled - top), axis=-1)
    return tokens, picked - top[:, 0] - jnp.log(total)


# ------------------------------------------------------------------ the loop
def _check_inputs(config: ModelConfig, prompt_ids, prompt_mask, opts: SamplingOptions):
    if prompt_ids.ndim != 2:
        raise ValueError(f"prompt_ids must be [batch, prompt_len], got shape {prompt_ids.shape}")
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_mask shape {prompt_mask.shape} must equal prompt_ids shape "
                         f"{prompt_ids.shape}")
    if not jnp.issubdtype(prompt_ids.dtype, jnp.integer):
        raise ValueError(f"prompt_ids must be integer token ids, got {prompt_ids.dtype}")
    total = prompt_ids.shape[1] + opts.max_new_tokens
    if config.position == "learned" and total > config.max_positions:
        raise ValueError(f"prompt length {prompt_ids.shape[1]} + max_new_tokens "
                         f"{opts.max_new_tokens} = {total} exceeds the model's "
                         f"max_positions {config.max_positions}")


def generate(config: ModelConfig, params: hk.Params, prompt_ids: jax.Array,
             prompt_mask: jax.Array, key: jax.Array, *, max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             top_p_mode: str = "transformers", greedy: bool = False,
             stop_token: Optional[int] = None,
             min_new_tokens: Optional[int] = None, pad_token_id: Optional[int] = None,
             mesh: Optional[Mesh] = None, return_logits: bool = False,
             axis_rules: Mapping[str, Any] = sharding.DEFAULT_AXIS_RULES,
             row_ids: Optional[jax.Array] = None, total_rows: Optional[int] = None):
    """Samples `max_new_tokens` tokens after left-padded prompts with a KV cache.

    Traceable inside jit; all keyword options are static Python values (see
    SamplingOptions for their meaning).

    Args:
      config: the model's ModelConfig.
      params: LM parameters (any sharding).
      prompt_ids: int [B, P] left-padded prompts.
      prompt_mask: bool [B, P], True at real tokens; every row needs at least one.
        Positions are the exclusive cumsum of the mask, so padding does not
        shift them; new token i of a row with n real tokens gets position n + i.
      key: PRNG key; step i uses fold_in(key, i).
      mesh: when given, the KV cache is constrained to CACHE_AXES (batch over
        the `batch` axes, kv heads over `tensor`) and the per-step logits to
        (batch, replicated vocab).
      return_logits: also return the raw per-step logits (for tests).
      axis_rules: logical -> mesh axis table used with `mesh`.
      row_ids, total_rows: for a micro-batch of a larger batch: int32 [B], the rows of
        the whole batch (of total_rows, static) these prompts are; each row then draws
        the random numbers it would draw in the whole batch (same tokens).

    Returns:
      tokens int32 [B, max_new_tokens]; logprobs float32 [B, max_new_tokens]
      (log_softmax(logits / temperature) at the emitted token, 0 after a stop);
      with return_logits also logits float32 [B, max_new_tokens, V] (logits[:, i]
      is the distribution token i was drawn from).
    """
    opts = SamplingOptions(max_new_tokens=max_new_tokens, temperature=temperature,
                           top_k=top_k, top_p=top_p, top_p_mode=top_p_mode, greedy=greedy,
                           stop_token=stop_token,
                           min_new_tokens=min_new_tokens, pad_token_id=pad_token_id)
    _check_inputs(config, prompt_ids, prompt_mask, opts)
    batch, prompt_len = prompt_ids.shape
    n_new = opts.max_new_tokens
    min_new = opts.min_new_tokens or 0
    prompt_ids = prompt_ids.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(bool)

    rows = None if row_ids is None else (row_ids, int(total_rows))

    def constrain(x, axes):
        return x if mesh is None else sharding.constrain(x, mesh, axes, axis_rules)

    def constrain_cache(cache):
        return KVCache(constrain(cache.k, CACHE_AXES), constrain(cache.v, CACHE_AXES))

    def pick(logits, step, done):
        """Token `step` from logits [B, V]; handles the stop token. done: bool [B]."""
        logits = constrain(logits, ("batch", None))
        tok, lp = sample_from_logits(logits, jax.random.fold_in(key, step),
                                     temperature=opts.temperature, top_k=opts.top_k,
                                     top_p=opts.top_p, top_p_mode=opts.top_p_mode,
                                     greedy=opts.greedy, rows=rows)
        if opts.stop_token is None:
            return tok, lp, done
        tok = jnp.where(done, jnp.int32(opts.pad_token_id), tok)
        lp = jnp.where(done, 0.0, lp)
        done = done | ((tok == opts.stop_token) & (step >= min_new))
        return tok, lp, done

    # Every slot after the prompt will hold a real token; causal masking hides
    # the ones not written yet, so the key mask is fixed for the whole loop.
    cache_mask = jnp.concatenate([prompt_mask, jnp.ones((batch, n_new), bool)], axis=1)
    n_real = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)  # [B]

    cache = constrain_cache(init_kv_cache(config, batch, prompt_len + n_new))
    hidden, _, cache = forward(config, params, prompt_ids, prompt_mask,
                               positions=position_ids_from_mask(prompt_mask), cache=cache,
                               cache_index=0, cache_mask=cache_mask, with_head=False)
    cache = constrain_cache(cache)
    first_logits = lm_head_logits(config, params, hidden[:, -1:])[:, 0]  # [B, V]
    done0 = jnp.zeros((batch,), bool)
    tok0, lp0, done0 = pick(first_logits, 0, done0)

    def step_fn(carry, step):
        cache, prev, done = carry
        # `prev` is token step-1; it goes to slot P + step - 1 at position n + step - 1.
        hidden, _, cache = forward(config, params, prev[:, None], jnp.ones((batch, 1), bool),
                                   positions=(n_real + step - 1)[:, None], cache=cache,
                                   cache_index=prompt_len + step - 1, cache_mask=cache_mask,
                                   with_head=False)
        cache = constrain_cache(cache)
        logits = lm_head_logits(config, params, hidden)[:, 0]
        tok, lp, done = pick(logits, step, done)
        out = (tok, lp, logits) if return_logits else (tok, lp)
        return (cache, tok, done), out

    if n_new > 1:
        _, outs = jax.lax.scan(step_fn, (cache, tok0, done0),
                               jnp.arange(1, n_new, dtype=jnp.int32))
    else:
        outs = (jnp.zeros((0, batch), jnp.int32), jnp.zeros((0, batch), jnp.float32),
                jnp.zeros((0, batch, config.vocab_size), jnp.float32))[:3 if return_logits else 2]
    tokens = jnp.concatenate([tok0[:, None], outs[0].T], axis=1)
    logprobs = jnp.concatenate([lp0[:, None], outs[1].T], axis=1)
    if return_logits:
        logits = jnp.concatenate([first_logits[:, None], jnp.swapaxes(outs[2], 0, 1)], axis=1)
        return tokens, logprobs, logits
    return tokens, logprobs


# ------------------------------------------------------------------ jitted entry
def make_generate_fn(config: ModelConfig, mesh: Optional[Mesh] = None, *,
                     param_rules=sharding.DEFAULT_PARAM_RULES,
                     axis_rules: Mapping[str, Any] = sharding.DEFAULT_AXIS_RULES,
                     **static_options):
    """A jitted `(params, prompt_ids, prompt_mask, key) -> (tokens, logprobs)`.

    Args:
      config: the model's ModelConfig.
      mesh: optional mesh. With it, params are expected sharded by
        `param_rules`/`axis_rules` (the tree of `param_shapes(config)`), prompts
        and outputs are batch-sharded, the key is replicated.
      **static_options: keyword options of `generate` (max_new_tokens, temperature,
        top_k, top_p, top_p_mode, greedy, stop_token, min_new_tokens, pad_token_id,
        return_logits).

    Returns:
      The jitted function (compiles once per prompt shape).
    """
    SamplingOptions(**{k: v for k, v in static_options.items() if k != "return_logits"})
    fn = functools.partial(generate, config, mesh=mesh, axis_rules=axis_rules,
                           **static_options)
    if mesh is None:
        return jax.jit(fn)
    params_sh = sharding.param_shardings(param_shapes(config), mesh, param_rules, axis_rules)
    batch2 = sharding.batch_sharding(mesh, 2, axis_rules)
    out_sh = (batch2, batch2)
    if static_options.get("return_logits"):
        out_sh += (sharding.batch_sharding(mesh, 3, axis_rules),)
    return jax.jit(fn, in_shardings=(params_sh, batch2, batch2, sharding.replicated(mesh)),
                   out_shardings=out_sh)
