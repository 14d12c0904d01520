"""KV-cache sampler for left-padded prompts.

`generate` runs one prefill of the prompt into a KV cache, then a `lax.scan` over
the new tokens that feeds one token per step; nothing leaves the device and every
Python-level option is static, so it traces inside a larger jit (the PPO rollout)
and compiles once per shape. The prefill scans the layers over a stacked cache of
the prompt slots (unrolled, XLA keeps several layers' gathered weights and
activations alive at once). The decode loop reads those prompt entries in place as
the prefix of a `PrefixKVCache` and keeps, per layer, one buffer for each row's
generated tokens, which each step updates in place before reading it (a stacked
[L, ...] cache is copied when a layer is sliced out of it, which on CPU cost more
than the rest of a step). With `samples_per_prompt=G` (the PPO rollout's groups)
each prompt is prefilled once and its G rows share its prefix entries: attention
reads a prompt's keys and values once for the group instead of once per row, and
they are never copied per row.

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

Cost per step: the LM head on [B, D] (logits [B, W], never [B, T, V]; the block is a
divisor of V where V has one in [256, 2048], so that W = V, else W is V padded to a
multiple of the block with zero weight columns, padded once per call, so that the
block reductions need no padded copy per step), two O(V) reading passes over
the logits for sampling (the row max, then the exp block sums; the scaled logits
are never written out), and the transformer on one token per row against the
cache. Top-p without top-k sorts the vocabulary each step (top-k
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
from pjit_ppo.models.transformer import (KVCache, PrefixKVCache, forward, init_kv_cache,
                                         lm_head_logits, lm_head_weights, param_shapes)
from pjit_ppo.padding import position_ids_from_mask

__all__ = ["SamplingOptions", "generate", "make_generate_fn", "sample_from_logits",
           "filter_logits", "keep_threshold", "block_size_for_vocab"]

# Block length of the two-level inverse-CDF search (speed only: any size draws exactly).
BLOCK_SIZE = 256
# The sampler's block: a divisor of the vocabulary in this range when there is one (no
# padded copy of the LM head's weight per call), else BLOCK_SIZE with padding.
_BLOCK_RANGE = (BLOCK_SIZE, 8 * BLOCK_SIZE)


def block_size_for_vocab(vocab: int) -> int:
    """The inverse-CDF block length `generate` uses for a vocabulary of `vocab` tokens.

    The smallest divisor of vocab in [256, 2048] (GPT-2's 50257 = 29 x 1733 -> 1733,
    GPT-J's 50400 -> 280, 32000 -> 256), so that the LM head's logits need no padding
    columns; BLOCK_SIZE (with padding) when vocab has no such divisor.
    """
    for block in range(_BLOCK_RANGE[0], min(_BLOCK_RANGE[1], vocab) + 1):
        if vocab % block == 0:
            return block
    return BLOCK_SIZE

# Logical axes of one layer's KV cache buffer [batch, n_kv_heads, max_len, head_dim]
# (the decode loop's prefix buffers [B / G, ...] and own buffers [B, ...] alike).
CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")


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


def _blocks(x: jax.Array, vocab: int, block: int, reduce, per_block) -> jax.Array:
    """Per-block reductions over the real tokens of x [B, W] (W a multiple of block):
    reduce(per_block(x) [B, n, block], axis=-1) -> [B, n], n = ceil(vocab / block);
    reduce is jnp.max or jnp.sum.

    One pass over the blocked view; the block that holds the last real token is redone
    from its real columns only when padding follows them. Sums go through a
    reduce_window: XLA:CPU otherwise hands the fused exp-and-sum to a library fusion
    that ran 3-4x slower than its own loop (see docs/performance.md).
    """
    batch, width = x.shape
    n = -(-vocab // block)
    if reduce is jnp.sum:
        out = jax.lax.reduce_window(per_block(x), jnp.zeros((), x.dtype), jax.lax.add,
                                    (1, block), (1, block), "VALID")[:, :n]
    else:
        out = reduce(per_block(x).reshape(batch, width // block, block), axis=-1)[:, :n]
    if n * block > vocab:
        last = reduce(per_block(x[:, (n - 1) * block:vocab]), axis=-1, keepdims=True)
        out = jnp.concatenate([out[:, :n - 1], last], axis=-1)
    return out


def _inverse_cdf_sample(logits, vocab, temperature, top, threshold, key, block: int,
                        rows=None):
    """Draws a token with probability proportional to exp(logits / temperature - top)
    where kept.

    Two-level inverse CDF: one uniform per row picks a block of `block` tokens
    from the cumulative block sums, then a token inside the block, whose
    weights are recomputed from a gathered [B, block] slice of the logits.
    Exact like a flat cumsum over V, but a [B, 50k] cumsum (and a gather from
    a fused [B, V] expression) is several times slower on CPU than the
    reductions used here. The scaled logits are never written out as a [B, V]
    array: the block sums read the raw logits in one pass, and only the chosen
    block is scaled again.

    Args:
      logits: float32 [B, W], W a multiple of block and >= vocab: raw logits of the
        vocab tokens, then padding columns (any values; never drawn).
      vocab: the number of real tokens.
      temperature: float, the logits are scaled as `logits / temperature`;
      top: float32 [B, 1], the row max of the scaled logits;
      threshold: None or float32 [B, 1] (scaled logits below it get weight 0);
      key: PRNG key; block: block size.
      rows: None, or (row_ids int32 [B], total_rows): these B rows are rows `row_ids`
        of a batch of total_rows, and draw exactly what they would draw there.

    Returns:
      (tokens int32 [B], scaled logit of each token float32 [B],
       total kept weight sum(exp(scaled - top)) float32 [B]).
    """
    batch = logits.shape[0]

    def weight(x):  # raw logits -> unnormalised kept probability
        scaled = x / temperature
        w = jnp.exp(scaled - top)
        return w if threshold is None else jnp.where(scaled >= threshold, w, 0.0)

    block_sums = _blocks(logits, vocab, block, jnp.sum, weight)  # [B, n]
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    total = block_cdf[:, -1:]
    if rows is None:
        u = jax.random.uniform(key, (batch, 1), jnp.float32)
    else:
        u = jnp.take(jax.random.uniform(key, (rows[1], 1), jnp.float32), rows[0], axis=0)
    u = u * total
    b = _search(block_cdf, u, block_sums)  # [B]
    below = jnp.take_along_axis(block_cdf - block_sums, b[:, None], axis=-1)  # mass before b
    xs = jnp.take_along_axis(logits.reshape(batch, -1, block), b[:, None, None],
                             axis=1)[:, 0]  # [B, block]
    ids = b[:, None] * block + jnp.arange(block, dtype=jnp.int32)[None, :]
    inner = jnp.where(ids < vocab, weight(xs), 0.0)
    i = _search(jnp.cumsum(inner, axis=-1), jnp.maximum(u - below, 0.0), inner)
    picked = jnp.take_along_axis(xs, i[:, None], axis=-1)[:, 0] / temperature
    return b * block + i, picked, total[:, 0]


def sample_from_logits(logits: jax.Array, key: jax.Array, *, temperature: float = 1.0,
                       top_k: int = 0, top_p: float = 1.0, top_p_mode: str = "transformers",
                       greedy: bool = False, block_size: int = BLOCK_SIZE, rows=None,
                       vocab_size: Optional[int] = None):
    """Draws one token per row and returns its unfiltered, temperature-scaled logprob.

    Args:
      logits: float [B, V] raw next-token logits, or [B, W] with W = V rounded up to a
        multiple of block_size and V = vocab_size: the columns from V on are padding
        (any values) and are never drawn (the sampler's LM head pads this way, so
        that no padded copy of the logits is made per step).
      key: PRNG key for this step (unused when greedy).
      temperature, top_k, top_p, top_p_mode, greedy: as in SamplingOptions.
      block_size: block length of the two-level inverse-CDF search (speed only).
      rows: None, or (row_ids int32 [B], total_rows): the draws these rows get as rows
        `row_ids` of a batch of total_rows (a micro-batch samples like the whole batch).
      vocab_size: V; default: all of logits' columns.

    Returns:
      (tokens int32 [B], logprobs float32 [B]) with logprobs from
      log_softmax(logits / temperature) (no top-k / top-p filtering).
    """
    logits = logits.astype(jnp.float32)
    width = logits.shape[-1]
    vocab = width if vocab_size is None else int(vocab_size)
    padded = -(-vocab // block_size) * block_size
    if width not in (vocab, padded):
        raise ValueError(f"logits have {width} columns; expected the vocabulary ({vocab}) or "
                         f"it rounded up to a multiple of block_size {block_size} ({padded})")
    real = logits[:, :vocab] if width > vocab else logits
    if width < padded:  # a padded copy: callers in a loop should pass padded logits
        logits = jnp.pad(logits, ((0, 0), (0, padded - width)))
    # Rounding is monotone, so max(logits / T) == max(logits) / T exactly (T > 0): the
    # scaled [B, V] array need not exist for the max.
    top = jnp.max(_blocks(logits, vocab, block_size, jnp.max, lambda x: x), axis=-1,
                  keepdims=True) / temperature  # [B, 1]
    if greedy:
        tokens = jnp.argmax(real / temperature, axis=-1).astype(jnp.int32)
        picked, threshold, total = top[:, 0], None, None
    else:
        threshold = keep_threshold(real / temperature, top_k, top_p, top_p_mode)
        tokens, picked, total = _inverse_cdf_sample(logits, vocab, temperature, top,
                                                    threshold, key, block_size, rows)
    if threshold is not None or total is None:  # need the unfiltered normaliser
        total = jnp.sum(jnp.exp(real / temperature - top), axis=-1)
    return tokens, picked - top[:, 0] - jnp.log(total)


def _padded_lm_head(config: ModelConfig, params, block: int):
    """The LM head as `hidden [B, 1, D] -> float32 logits [B, W]`, W = V rounded up to
    a multiple of `block` with zero weight columns (see `sample_from_logits`): the
    sampler's block reductions then read the head's output without a padded copy
    per step. The padded weight is made once, outside the decode loop; the real
    columns are the same dot as `lm_head_logits`."""
    vocab = config.vocab_size
    width = -(-vocab // block) * block
    if width == vocab:
        return lambda hidden: lm_head_logits(config, params, hidden)[:, 0]
    w, b, vocab_major = lm_head_weights(config, params)
    extra = width - vocab
    w = jnp.pad(w, ((0, extra), (0, 0)) if vocab_major else ((0, 0), (0, extra)))
    padded = ({"transformer/embed": {"embeddings": w}} if vocab_major
              else {"lm_head": {"w": w} if b is None else {"w": w, "b": jnp.pad(b, (0, extra))}})
    return lambda hidden: lm_head_logits(config, padded, hidden)[:, 0]


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
             row_ids: Optional[jax.Array] = None, total_rows: Optional[int] = None,
             samples_per_prompt: int = 1):
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
      samples_per_prompt: G (static). With G > 1 the rows come in contiguous groups of
        G copies of one prompt (as the PPO rollout lays them out): the prefill then
        runs on the first row of each group only, the group's rows share its KV
        entries as the decode loop's prefix (a PrefixKVCache) and its first logits are
        copied to them (a G-fold smaller prefill; the other rows' prompt_ids are not
        read). Same samples as prefilling every row, up to the rounding of a matmul
        over fewer rows. With a mesh whose batch devices do not divide B / G, every
        row is prefilled (no data moves between devices).

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
        return PrefixKVCache(*(tuple(constrain(x, CACHE_AXES) for x in part)
                               for part in cache))

    block = block_size_for_vocab(config.vocab_size)
    head = _padded_lm_head(config, params, block)  # [B, 1, D] -> [B, W], W >= V

    def pick(logits, step, done):
        """Token `step` from logits [B, W]; handles the stop token. done: bool [B]."""
        logits = constrain(logits, ("batch", None))
        tok, lp = sample_from_logits(logits, jax.random.fold_in(key, step),
                                     temperature=opts.temperature, top_k=opts.top_k,
                                     top_p=opts.top_p, top_p_mode=opts.top_p_mode,
                                     greedy=opts.greedy, block_size=block, rows=rows,
                                     vocab_size=config.vocab_size)
        if opts.stop_token is None:
            return tok, lp, done
        tok = jnp.where(done, jnp.int32(opts.pad_token_id), tok)
        lp = jnp.where(done, 0.0, lp)
        done = done | ((tok == opts.stop_token) & (step >= min_new))
        return tok, lp, done

    n_real = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)  # [B]

    g = _prefill_group(batch, samples_per_prompt, mesh, axis_rules)

    def first_of_groups(x):  # [B, ...] -> [B / g, ...]: the first row of each group
        return x if g == 1 else x.reshape((batch // g, g) + x.shape[1:])[:, 0]

    def to_groups(x):  # [B / g, ...] -> [B, ...]: each row copied to its group
        return x if g == 1 else jnp.repeat(x, g, axis=0)

    prefill_ids, prefill_mask = first_of_groups(prompt_ids), first_of_groups(prompt_mask)
    if g > 1 and mesh is not None:
        prefill_ids, prefill_mask = (constrain(x, ("batch", None))
                                     for x in (prefill_ids, prefill_mask))
    # The prefill scans the layers over a stacked cache of the prompt slots (one layer's
    # weights and activations live at a time, as in any full forward). The decode loop
    # reads each layer's entries as the prefix its group shares, and writes the
    # generated tokens' entries into per-row buffers (token i goes to own slot i - 1; the
    # last token is never fed back).
    prefill_cache = init_kv_cache(config, batch // g, prompt_len)
    if mesh is not None:
        prefill_cache = KVCache(*(constrain(x, ("layers",) + CACHE_AXES) for x in prefill_cache))
    hidden, _, prefill_cache = forward(config, params, prefill_ids, prefill_mask,
                                       positions=position_ids_from_mask(prefill_mask),
                                       cache=prefill_cache, cache_index=0,
                                       cache_mask=prefill_mask, with_head=False)
    own = init_kv_cache(config, batch, max(n_new - 1, 1), per_layer=True)
    cache = constrain_cache(PrefixKVCache(
        tuple(prefill_cache.k[i] for i in range(config.n_layers)),
        tuple(prefill_cache.v[i] for i in range(config.n_layers)), own.k, own.v))
    first_logits = to_groups(head(hidden[:, -1:]))  # [B, W]
    done0 = jnp.zeros((batch,), bool)
    tok0, lp0, done0 = pick(first_logits, 0, done0)

    def step_fn(carry, step):
        cache, prev, done = carry
        # Tie the weights to the step so that XLA does not hoist the layers' weight slices
        # (and their gathers and dtype casts) out of the loop: with the layers unrolled
        # that keeps converted copies of many layers' weights alive for the whole loop
        # (GPT-J's sampler, batch 64 on 8 devices: 4.85 GB of temporaries per device
        # without the barrier, 3.20 GB with it).
        step_params, prev = jax.lax.optimization_barrier((params, prev))
        # `prev` is token step-1; it goes to own slot step - 1 at position n + step - 1.
        hidden, _, cache = forward(config, step_params, prev[:, None], jnp.ones((batch, 1), bool),
                                   positions=(n_real + step - 1)[:, None], cache=cache,
                                   cache_index=step - 1, cache_mask=prefill_mask,
                                   with_head=False)
        cache = constrain_cache(cache)
        logits = head(hidden)
        tok, lp, done = pick(logits, step, done)
        out = (tok, lp, logits[:, :config.vocab_size]) if return_logits else (tok, lp)
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
        logits = jnp.concatenate([first_logits[:, None, :config.vocab_size],
                                  jnp.swapaxes(outs[2], 0, 1)], axis=1)
        return tokens, logprobs, logits
    return tokens, logprobs


def _prefill_group(batch: int, samples_per_prompt: int, mesh: Optional[Mesh],
                   axis_rules: Mapping[str, Any]) -> int:
    """How many rows share one prefill: samples_per_prompt, or 1 where that cannot be
    done locally (B / G rows not split evenly over the mesh's batch devices)."""
    g = int(samples_per_prompt)
    if g < 1 or batch % g:
        raise ValueError(f"samples_per_prompt={samples_per_prompt} must be a positive divisor "
                         f"of the batch ({batch} rows)")
    if g > 1 and mesh is not None:
        try:
            sharding.spec_for("prefill rows", (batch // g,), ("batch",), mesh, axis_rules)
        except sharding.ShardingError:
            return 1
    return g


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
        return_logits, samples_per_prompt).

    Returns:
      The jitted function (compiles once per prompt shape).
    """
    SamplingOptions(**{k: v for k, v in static_options.items()
                       if k not in ("return_logits", "samples_per_prompt")})
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
