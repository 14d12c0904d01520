"""One Haiku decoder for GPT-J, GPT-2, GPT-NeoX/Pythia and Llama.

Parameter paths are a contract (partition rules, HF conversion and checkpoints
all key on them); every layer parameter carries a leading `n_layers` axis
because the blocks are stacked (`_stacked_layers`) and scanned:

  transformer/embed         embeddings [vocab, d_model]
  transformer/pos_embed     embeddings [max_positions, d_model]      (learned positions)
  transformer/layers/ln_1   scale, offset [L, d_model]               (offset: layernorm only)
  transformer/layers/ln_2   scale, offset [L, d_model]               (absent for GPT-J)
  transformer/layers/attn/q w [L, d_model, n_heads, head_dim], b [L, n_heads, head_dim]
  transformer/layers/attn/k w [L, d_model, n_kv_heads, head_dim], b [L, n_kv_heads, head_dim]
  transformer/layers/attn/v w [L, d_model, n_kv_heads, head_dim], b [L, n_kv_heads, head_dim]
  transformer/layers/attn/o w [L, n_heads, head_dim, d_model], b [L, d_model]
  transformer/layers/mlp/fc_in   w [L, d_model, d_ff], b [L, d_ff]
  transformer/layers/mlp/fc_gate w [L, d_model, d_ff], b [L, d_ff]  (gated MLP only)
  transformer/layers/mlp/fc_out  w [L, d_ff, d_model], b [L, d_model]
  transformer/ln_f          scale, offset [d_model]
  lm_head                   w [d_model, vocab], b [vocab]            (untied head only)

Biases exist only where the architecture has them (ModelConfig.*_bias). With LoRA
(ModelConfig.lora) each targeted projection module also holds lora_a [L, *in, rank] and
lora_b [L, rank, *out] (`pjit_ppo.models.lora`).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp

from pjit_ppo.models import lora, projection
from pjit_ppo.models.config import ModelConfig
from pjit_ppo.padding import position_ids_from_mask

# A large finite negative instead of -inf, so a row whose keys are all masked
# (a pad query) gives a uniform softmax rather than NaN.
_MASK_VALUE = -1e30


class KVCache(NamedTuple):
    """Per-layer keys and values, in one of two layouts:

    - stacked: k, v [n_layers, batch, n_kv_heads, max_len, head_dim] arrays; the
      layers run as a scan that slices each layer's cache out of the stack;
    - per layer: k, v tuples of n_layers arrays [batch, n_kv_heads, max_len, head_dim];
      the layers are unrolled and each reads and updates its own buffer in place.
      This is the decode layout: slicing a layer out of the stack copies it, which
      costs more than the rest of a one-token step on CPU.

    Heads before length, so attention reads the cache without a transpose.
    """
    k: Any
    v: Any

    @property
    def per_layer(self) -> bool:
        """True for the per-layer layout (tuples of arrays)."""
        return isinstance(self.k, (tuple, list))


class PrefixKVCache(NamedTuple):
    """Decode cache for groups of G consecutive rows that share a prompt (G >= 1):

    - prefix_k, prefix_v: tuples of n_layers arrays [B / G, n_kv_heads, P, head_dim], the
      prompt's keys and values, stored once per group and only read;
    - k, v: tuples of n_layers arrays [B, n_kv_heads, N, head_dim], each row's own slots
      for the tokens generated after the prompt, written in place (as the per-layer
      layout of KVCache).

    Attention reads a group's prompt entries once for its G rows (a [G, head_dim] x
    [head_dim, P] product per group and head instead of G matrix-vector products), and
    the prompt part is never copied per row. With this cache, `forward`'s cache_index is
    the slot in the own part and cache_mask is the prefix's key mask [B / G, P].
    """
    prefix_k: Any
    prefix_v: Any
    k: Any
    v: Any


def init_kv_cache(config: ModelConfig, batch: int, max_len: int, dtype=None, *,
                  per_layer: bool = False) -> KVCache:
    """An all-zero cache for `batch` rows of up to `max_len` tokens (compute dtype);
    stacked, or with per_layer=True one buffer per layer (see KVCache)."""
    dtype = dtype or config.compute_dtype
    shape = (batch, config.n_kv_heads, max_len, config.head_dim)
    if per_layer:
        return KVCache(tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)),
                       tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)))
    shape = (config.n_layers,) + shape
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


# ----------------------------------------------------------------- layers
def _param(name, shape, init, dtype=jnp.float32):
    return hk.get_parameter(name, shape, dtype, init=init)


def _norm(config: ModelConfig, x: jax.Array, name: str) -> jax.Array:
    """LayerNorm or RMSNorm computed in fp32, returned in x's dtype."""
    with hk.name_scope(name):
        d = x.shape[-1]
        scale = _param("scale", [d], jnp.ones)
        xf = x.astype(jnp.float32)
        if config.norm == "rmsnorm":
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + config.norm_eps)
            return (y * scale).astype(x.dtype)
        offset = _param("offset", [d], jnp.zeros)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + config.norm_eps)
        return (y * scale + offset).astype(x.dtype)


#: A projection's index, folded into its layer's dropout key (`_lora_term`).
_PROJECTION_INDEX = {name.split("/")[1]: i for i, name in enumerate(lora.PROJECTIONS)}


def _lora_term(x, name, in_shape, out_shape, dtype, contract, adapter):
    """scale * dropout(x) @ lora_a @ lora_b [..., *out_shape] (the unmerged low-rank
    term; `pjit_ppo.models.lora`). adapter: (rank, scale, dropout)."""
    rank, scale, dropout = adapter
    fan_in = 1
    for n in in_shape:
        fan_in *= n
    a = _param("lora_a", list(in_shape) + [rank], hk.initializers.RandomNormal(fan_in ** -0.5))
    b = _param("lora_b", [rank] + list(out_shape), jnp.zeros)
    key = lora.layer_dropout_key() if dropout > 0 else None
    if key is not None:  # a training step's view: drop out the adapters' input
        keep = jax.random.bernoulli(jax.random.fold_in(key, _PROJECTION_INDEX[name]),
                                    1.0 - dropout, x.shape)
        x = jnp.where(keep, x / jnp.asarray(1.0 - dropout, x.dtype), jnp.zeros((), x.dtype))
    h = jnp.tensordot(x, a.astype(dtype), axes=contract)
    return jnp.tensordot(h, (b * scale).astype(dtype), axes=1)


def _dense(x, name, in_shape, out_shape, bias, dtype, contract=1, adapter=None):
    """x [..., *in_shape] @ w [*in_shape, *out_shape] (+ b [*out_shape]), plus the LoRA
    term when `adapter` is (rank, scale, dropout) (`lora.layer_adapter`)."""
    with hk.name_scope(name):
        w = _param("w", list(in_shape) + list(out_shape), hk.initializers.RandomNormal(0.02))
        y = projection.project(x, w.astype(dtype), contract)
        if adapter is not None:
            y = y + _lora_term(x, name, in_shape, out_shape, dtype, contract, adapter)
        if bias:
            y = y + _param("b", list(out_shape), jnp.zeros).astype(dtype)
        return y


def _activation(name):
    return {"gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
            "gelu": functools.partial(jax.nn.gelu, approximate=False),
            "silu": jax.nn.silu, "relu": jax.nn.relu}[name]


def _rotary(config: ModelConfig, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Applies rotary embeddings to the first rotary_dim dims of each head.

    x: [B, T, heads, head_dim]; positions: int [B, T].
    """
    rd = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, rd, 2, dtype=jnp.float32) / rd))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rd/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    rot, rest = x[..., :rd].astype(jnp.float32), x[..., rd:]
    if config.rotary_interleaved:  # GPT-J: pairs (0,1), (2,3), ...
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
    else:  # NeoX / Llama: first half with second half
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([out.astype(x.dtype), rest], axis=-1)


def _attention_bias(allowed: jax.Array) -> jax.Array:
    """bool [B, T, S] -> additive float32 bias [B, 1, 1, T, S] (0 or a large negative).

    Built once per forward and shared by all layers: cheaper than a select in
    every layer, and its gradient is trivial.
    """
    return jnp.where(allowed, 0.0, _MASK_VALUE).astype(jnp.float32)[:, None, None]


def _attention_biases(attention_mask, key_mask, cache_index, with_cache,
                      write_first=False):
    """(bias over the new tokens [B,1,1,T,T], bias over the cache slots [B,1,1,T,S] or None).

    New tokens see earlier new tokens (causal) that are real; with a cache they
    also see every real slot before cache_index (the slots being written now are
    handled by the new-token part, so stale cache contents are never read).
    With write_first (the per-layer cache, written before it is read): (None, bias
    over all S slots), new token t seeing every real slot up to cache_index + t.
    """
    if write_first:
        t, s = attention_mask.shape[1], key_mask.shape[1]
        upto = jnp.arange(s)[None, :] <= cache_index + jnp.arange(t)[:, None]  # [T, S]
        return None, _attention_bias(upto[None] & key_mask.astype(bool)[:, None, :])
    t = attention_mask.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    new = _attention_bias(causal[None] & attention_mask[:, None, :].astype(bool))
    if not with_cache:
        return new, None
    s = key_mask.shape[1]
    before = (jnp.arange(s) < cache_index)[None, :] & key_mask.astype(bool)  # [B, S]
    return new, _attention_bias(jnp.broadcast_to(before[:, None, :], (before.shape[0], t, s)))


def _prefix_biases(prefix_mask, n_own: int, n_new: int, cache_index):
    """Biases for a PrefixKVCache: (over the prefix slots [B / G, 1, 1, 1, 1, P], over
    the own slots [1, 1, 1, 1, T, N]). Every own slot holds a real token; new token t
    sees the own slots up to cache_index + t (the ones written so far, itself included)."""
    prefix = jnp.where(prefix_mask.astype(bool), 0.0, _MASK_VALUE).astype(jnp.float32)
    upto = jnp.arange(n_own)[None, :] <= cache_index + jnp.arange(n_new)[:, None]  # [T, N]
    own = jnp.where(upto, 0.0, _MASK_VALUE).astype(jnp.float32)
    return prefix[:, None, None, None, None, :], own[None, None, None, None]


def _write_slots(buf, new, index):
    """new [B, T, KV, hd] -> slots index.. of buf [B, KV, S, hd] (in place under jit)."""
    return jax.lax.dynamic_update_slice(
        buf, jnp.swapaxes(new, 1, 2).astype(buf.dtype), (0, 0, index, 0))


def _prefix_attention(qg, k, v, cache_kv, biases, dtype):
    """Attention of queries qg [B, T, KV, grp, hd] (scaled) over a PrefixKVCache layer.

    cache_kv: (prefix k, prefix v [B / G, KV, P, hd], own k, own v [B, KV, N, hd],
    index); k, v [B, T, KV, hd] are the new tokens', written at own slots index..
    Returns (out [B, T, KV, grp, hd], (own k, own v) updated).
    """
    pk, pv, ck, cv, index = cache_kv
    ck, cv = _write_slots(ck, k, index), _write_slots(cv, v, index)
    b, t, kv, grp, hd = qg.shape
    n, p = pk.shape[0], pk.shape[2]
    g = b // n
    bias_prefix, bias_own = biases
    # The own buffers are read per row in their own layout (viewing them per group
    # made XLA copy them every step); only the small scores are regrouped.
    prefix = jnp.einsum("ngtkrd,nksd->nkgrts", qg.reshape(n, g, t, kv, grp, hd),
                        pk.astype(dtype), preferred_element_type=jnp.float32) + bias_prefix
    own = jnp.einsum("btkrd,bksd->bkrts", qg, ck.astype(dtype),
                     preferred_element_type=jnp.float32)
    own = jnp.moveaxis(own.reshape((n, g) + own.shape[1:]), 1, 2) + bias_own  # [n,kv,g,..]
    probs = jax.nn.softmax(jnp.concatenate([prefix, own], axis=-1), axis=-1).astype(dtype)
    probs_own = jnp.moveaxis(probs[..., p:], 2, 1).reshape(b, kv, grp, t, -1)
    out = (jnp.einsum("nkgrts,nksd->ngtkrd", probs[..., :p], pv.astype(dtype))
           .reshape(b, t, kv, grp, hd)
           + jnp.einsum("bkrts,bksd->btkrd", probs_own, cv.astype(dtype)))
    return out, (ck, cv)


def _head_major_attention(qg, k, v, bias, dtype):
    """Attention of qg [B, T, KV, G, hd] (scaled) over k, v [B, S, KV, hd] without a cache,
    as batched [G*T, hd] x [hd, S] and [G*T, S] x [S, hd] matmuls per (row, KV head).

    The same dot products as the token-major einsums; XLA:CPU runs these head-major
    batched matmuls about twice as fast (docs/performance.md). bias: [B, 1, 1, T, S].
    Returns [B, T, KV, G, hd].
    """
    b, t, kv, g, hd = qg.shape
    s = k.shape[1]
    qh = jnp.transpose(qg, (0, 2, 3, 1, 4)).reshape(b, kv, g * t, hd)
    kh, vh = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
    scores = jnp.einsum("bktd,bksd->bkts", qh, kh, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv, g, t, s) + bias
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype).reshape(b, kv, g * t, s)
    out = jnp.einsum("bkts,bksd->bktd", probs, vh).reshape(b, kv, g, t, hd)
    return jnp.transpose(out, (0, 3, 1, 2, 4))


def _attention(config, x, positions, biases, cache_kv, query=None):
    """Causal self-attention of the new tokens x over themselves and the cache.

    x: [B, T, D]; positions int [B, T]; biases from `_attention_biases`;
    cache_kv: None; or (k, v) [B, KV, S, hd], read only (a stacked cache's layer);
      or (k, v, cache_index): this layer's own buffers (the per-layer cache), into
      which the new tokens' keys and values are written at slots cache_index..
      before attention reads them (no copy of the buffers: each is read only after
      its update). biases[1] then covers all S slots (`_attention_biases`);
      or (prefix k, prefix v, k, v, cache_index): a PrefixKVCache layer, with
      biases from `_prefix_biases` (see `_prefix_attention`).
    query: None, or a static (start, stop): only positions start..stop-1 are queries
      (keys and values still come from all T positions). No cache then.
    Returns y [B, T', D] (T' = T, or stop - start) and: the new tokens' (k, v)
    [B, T, KV, hd] (the caller writes them into a stacked cache once for all
    layers, instead of copying the cache per layer); or with a layer's own buffers,
    the updated buffers.
    """
    c, dtype = config, x.dtype
    h, kv, hd = c.n_heads, c.n_kv_heads, c.head_dim
    bias_new, bias_cache = biases
    start, stop = (0, x.shape[1]) if query is None else query
    with hk.name_scope("attn"):
        q = _dense(x[:, start:stop], "q", [c.d_model], [h, hd], c.qkv_bias, dtype,
                   adapter=lora.layer_adapter(c, "attn/q"))
        k = _dense(x, "k", [c.d_model], [kv, hd], c.qkv_bias, dtype,
                   adapter=lora.layer_adapter(c, "attn/k"))
        v = _dense(x, "v", [c.d_model], [kv, hd], c.qkv_bias, dtype,
                   adapter=lora.layer_adapter(c, "attn/v"))
        if c.position == "rotary":
            q, k = _rotary(c, q, positions[:, start:stop]), _rotary(c, k, positions)
        if query is not None:
            bias_new = bias_new[..., start:stop, :]
        b, t = q.shape[:2]
        qg = (q * jnp.asarray(hd ** -0.5, dtype)).reshape(b, t, kv, h // kv, hd)
        new_kv = (k, v)
        if cache_kv is not None and len(cache_kv) == 5:  # shared prefix + own buffers
            out, new_kv = _prefix_attention(qg, k, v, cache_kv, biases, dtype)
        elif cache_kv is not None and len(cache_kv) == 3:  # a layer's own buffers: write, read
            ck, cv, index = cache_kv
            ck, cv = _write_slots(ck, k, index), _write_slots(cv, v, index)
            scores = jnp.einsum("btkgd,bksd->bkgts", qg, ck.astype(dtype),
                                preferred_element_type=jnp.float32) + bias_cache
            probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
            out = jnp.einsum("bkgts,bksd->btkgd", probs, cv.astype(dtype))
            new_kv = (ck, cv)
        elif cache_kv is None:
            out = _head_major_attention(qg, k, v, bias_new, dtype)
        else:
            scores = jnp.einsum("btkgd,bskd->bkgts", qg, k,
                                preferred_element_type=jnp.float32) + bias_new
            ck, cv = cache_kv
            cached = jnp.einsum("btkgd,bksd->bkgts", qg, ck.astype(dtype),
                                preferred_element_type=jnp.float32) + bias_cache
            probs = jax.nn.softmax(jnp.concatenate([cached, scores], axis=-1),
                                   axis=-1).astype(dtype)
            s = ck.shape[2]
            out = (jnp.einsum("bkgts,bksd->btkgd", probs[..., :s], cv.astype(dtype))
                   + jnp.einsum("bkgts,bskd->btkgd", probs[..., s:], v))
        y = _dense(out.reshape(b, t, h, hd), "o", [h, hd], [c.d_model], c.attn_out_bias,
                   dtype, contract=2, adapter=lora.layer_adapter(c, "attn/o"))
    return y, new_kv


def _mlp(config, x):
    c, dtype = config, x.dtype
    act = _activation(c.activation)
    with hk.name_scope("mlp"):
        hidden = _dense(x, "fc_in", [c.d_model], [c.d_ff], c.mlp_bias, dtype,
                        adapter=lora.layer_adapter(c, "mlp/fc_in"))
        if c.gated_mlp:  # Llama: down(act(gate(x)) * up(x)); fc_in is "up"
            hidden = act(_dense(x, "fc_gate", [c.d_model], [c.d_ff], c.mlp_bias, dtype,
                                adapter=lora.layer_adapter(c, "mlp/fc_gate"))) * hidden
        else:
            hidden = act(hidden)
        return _dense(hidden, "fc_out", [c.d_ff], [c.d_model], c.mlp_bias, dtype,
                      adapter=lora.layer_adapter(c, "mlp/fc_out"))


def _block(config, x, positions, biases, cache_kv, query=None):
    """One decoder layer; returns (x, the new tokens' (k, v)).

    With query=(start, stop) only those positions come out ([B, stop - start, D]):
    the rest of the layer's output is not computed.
    """
    c = config
    start, stop = (0, x.shape[1]) if query is None else query
    if c.parallel_residual:
        h1 = _norm(c, x, "ln_1")
        h2 = h1[:, start:stop] if c.shared_parallel_norm else _norm(c, x[:, start:stop], "ln_2")
        attn, new_kv = _attention(c, h1, positions, biases, cache_kv, query)
        return x[:, start:stop] + attn + _mlp(c, h2), new_kv
    attn, new_kv = _attention(c, _norm(c, x, "ln_1"), positions, biases, cache_kv, query)
    x = x[:, start:stop] + attn
    return x + _mlp(c, _norm(c, x, "ln_2")), new_kv


def _checkpointed(config, fn):
    """fn under the config's remat policy (a pure function: params are arguments)."""
    policy = config.remat_policy
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn)
    if not hasattr(jax.checkpoint_policies, policy):
        raise ValueError(f"unknown remat_policy {policy!r}: use 'none', 'full' or a name in "
                         f"jax.checkpoint_policies")
    return jax.checkpoint(fn, policy=getattr(jax.checkpoint_policies, policy))


def _stacked_layers(config, block, x, per_layer, last_layer_query=None):
    """Applies `block` to x once per layer, each layer with its own parameters.

    block(x, *per_layer_inputs) -> (x, per_layer_output) is a Haiku function (with
    last_layer_query it must also take a `query=` keyword); its parameters are
    created once per layer and stacked on a leading n_layers axis under "layers"
    (the paths of the module docstring). Layers run as a `lax.scan`
    (config.scan_unroll layers per step), each under the remat policy.

    per_layer: a tuple of arrays with a leading n_layers axis, sliced per layer; or a
      tuple of n_layers-long tuples of arrays, one per layer: the layers are then
      unrolled (no slicing of the inputs) and the outputs come back as tuples too.
    last_layer_query: None, or a static (start, stop) passed to the last layer only,
      which then computes only those positions; the layers before it still compute
      all of them (the last layer's keys and values need them).

    Returns (x, stacked per-layer outputs); per-layer outputs are None with
    last_layer_query.
    """
    c = config
    layer = hk.transform(block)

    def init_stacked(x, rng):
        first = jax.tree.map(lambda a: a[0], per_layer)
        keys = jax.random.split(rng, c.n_layers)
        return jax.vmap(lambda key: layer.init(key, x, *first))(keys)

    unrolled = bool(per_layer) and isinstance(per_layer[0], (tuple, list))
    if unrolled:
        per_layer_lists, per_layer = per_layer, tuple(inp[0][None] for inp in per_layer)
    params = hk.lift(init_stacked, name="layers")(x, hk.maybe_next_rng_key())

    def apply(p, x, *inputs, **kwargs):
        return layer.apply(p, None, x, *inputs, **kwargs)

    if unrolled:
        outputs = []
        for i in range(c.n_layers):
            x, out = _checkpointed(c, apply)(jax.tree.map(lambda a: a[i], params), x,
                                             *(inp[i] for inp in per_layer_lists))
            outputs.append(out)
        return x, tuple(tuple(o) for o in zip(*outputs))

    def step(x, scanned):
        p, inputs = scanned
        return _checkpointed(c, apply)(p, x, *inputs)

    if last_layer_query is None:
        return jax.lax.scan(step, x, (params, per_layer), length=c.n_layers,
                            unroll=c.scan_unroll)
    if per_layer:
        raise ValueError("last_layer_query does not combine with per-layer inputs (a cache)")
    # The first L - 1 layers index the stacked weights inside the (rematerialised) step
    # instead of scanning over `params[:-1]`: that slice would copy L-1/L of every
    # weight before the scan, and indexing outside the remat would save each layer's
    # weights as a residual. The full stack is a loop constant: no copy, no residual.
    def layer_at(p_all, x, i):
        return apply(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False),
                                  p_all), x)

    def step_at(x, i):
        return _checkpointed(c, layer_at)(params, x, i)

    x, _ = jax.lax.scan(step_at, x, jnp.arange(c.n_layers - 1),
                        unroll=max(1, min(c.scan_unroll, c.n_layers - 1)))

    def last_layer(p_all, x):
        return apply(jax.tree.map(lambda a: a[-1], p_all), x, query=last_layer_query)
    x, _ = _checkpointed(c, last_layer)(params, x)
    return x, None


def _trunk(config, input_ids, attention_mask, positions, cache, cache_index, key_mask,
           output_slice=None):
    """Token ids -> final hidden states [B, T, D] (after ln_f), the new cache, and the
    token embedding table (reused by a tied LM head). With output_slice=(start, stop)
    the hidden states are [B, stop - start, D] for those positions only."""
    c = config
    dtype = jnp.dtype(c.compute_dtype)
    with hk.name_scope("transformer"):
        with hk.name_scope("embed"):
            emb = _param("embeddings", [c.vocab_size, c.d_model],
                         hk.initializers.RandomNormal(0.02))
        x = jnp.take(emb, input_ids, axis=0).astype(dtype)
        if c.position == "learned":
            with hk.name_scope("pos_embed"):
                pos = _param("embeddings", [c.max_positions, c.d_model],
                             hk.initializers.RandomNormal(0.01))
            x = x + jnp.take(pos, positions, axis=0).astype(dtype)

        prefix_cache = isinstance(cache, PrefixKVCache)
        per_layer_cache = prefix_cache or (cache is not None and cache.per_layer)
        if prefix_cache:
            biases = _prefix_biases(key_mask, cache.k[0].shape[2], input_ids.shape[1],
                                    cache_index)
        else:
            biases = _attention_biases(attention_mask, key_mask, cache_index,
                                       cache is not None, write_first=per_layer_cache)
        if cache is None:
            def layer(x, query=None):
                return _block(c, x, positions, biases, None, query)[0], None
            x, _ = _stacked_layers(c, layer, x, (), output_slice)
            new_cache = None
        else:
            if output_slice is not None:
                raise ValueError("output_slice is for full forwards (no cache)")

            if prefix_cache:  # read the shared prefix, update the own buffers (unrolled)
                def layer(x, pk, pv, ck, cv):
                    return _block(c, x, positions, biases, (pk, pv, ck, cv, cache_index))
                x, (ks, vs) = _stacked_layers(
                    c, layer, x, (cache.prefix_k, cache.prefix_v, cache.k, cache.v))
                new_cache = PrefixKVCache(cache.prefix_k, cache.prefix_v, ks, vs)
            elif per_layer_cache:  # each layer updates its own buffers (unrolled layers)
                def layer(x, ck, cv):
                    return _block(c, x, positions, biases, (ck, cv, cache_index))
                x, (ks, vs) = _stacked_layers(c, layer, x, (cache.k, cache.v))
                new_cache = KVCache(ks, vs)
            else:  # one in-place write of all layers' new entries (read-only above)
                def layer(x, ck, cv):
                    return _block(c, x, positions, biases, (ck, cv))
                x, (ks, vs) = _stacked_layers(c, layer, x, (cache.k, cache.v))

                def write(buf, new):  # new: [L, B, T, KV, hd] -> slots cache_index.. of buf
                    return jax.lax.dynamic_update_slice(
                        buf, jnp.swapaxes(new, 2, 3).astype(buf.dtype), (0, 0, 0, cache_index, 0))
                new_cache = KVCache(write(cache.k, ks), write(cache.v, vs))
        x = _norm(c, x, "ln_f")
    return x, new_cache, emb


def _lm_head(config, hidden, emb):
    """Creates the head parameters (untied) and applies lm_head_logits.

    emb: the token embedding table from `_trunk`, used by a tied head. (Re-entering
    hk.name_scope("transformer") here would create a second, *separate*
    `transformer_1/embed` parameter.)
    """
    c = config
    if c.tie_word_embeddings:
        return lm_head_logits(c, {"transformer/embed": {"embeddings": emb}}, hidden)
    with hk.name_scope("lm_head"):
        head = {"w": _param("w", [c.d_model, c.vocab_size], hk.initializers.RandomNormal(0.02))}
        if c.lm_head_bias:
            head["b"] = _param("b", [c.vocab_size], jnp.zeros)
    return lm_head_logits(c, {"lm_head": head}, hidden)


@functools.lru_cache(maxsize=None)
def _transformed(config: ModelConfig):
    def forward(input_ids, attention_mask, positions, cache, cache_index, key_mask, with_head,
                output_slice=None):
        hidden, new_cache, emb = _trunk(config, input_ids, attention_mask, positions, cache,
                                        cache_index, key_mask, output_slice)
        logits = _lm_head(config, hidden, emb) if with_head else None
        return hidden, logits, new_cache

    return hk.without_apply_rng(hk.transform(forward))


@functools.lru_cache(maxsize=None)
def _full_forward(config: ModelConfig):
    """The cache-free forward as one jitted function of (params, ids, mask, positions).

    Inside a traced program (a PPO phase scores the same batch with the policy, the
    reference and the critic), calls with the same parameter structure and shapes reuse
    one trace and one lowered function instead of tracing the model again each time;
    XLA inlines the call, so the compiled program is the same.
    """
    def apply(params, input_ids, attention_mask, positions, with_head, output_slice):
        return _transformed(config).apply(params, input_ids, attention_mask, positions,
                                          None, 0, attention_mask.astype(bool), with_head,
                                          output_slice)

    return jax.jit(apply, static_argnames=("with_head", "output_slice"))


# ----------------------------------------------------------------- public API
def init_params(config: ModelConfig, key: jax.Array) -> hk.Params:
    """Random LM parameters (normal(0.02) weights, zero biases, unit norm scales), fp32."""
    ids = jnp.zeros((1, 2), jnp.int32)
    mask = jnp.ones((1, 2), bool)
    return _transformed(config).init(key, ids, mask, position_ids_from_mask(mask), None, 0,
                                     mask, True)


def param_shapes(config: ModelConfig) -> hk.Params:
    """The parameter tree as jax.ShapeDtypeStruct leaves, without allocating anything.

    Tracing the model's init costs a fraction of a second; the tree is kept per config
    in the process, and across launches in the program cache when it is on."""
    return jax.tree.map(lambda x: x, _param_shapes(config))


@functools.lru_cache(maxsize=None)
def _param_shapes(config: ModelConfig) -> hk.Params:
    from pjit_ppo import program_cache
    return program_cache.shapes(
        "models/param_shapes", repr(config),
        lambda: jax.eval_shape(functools.partial(init_params, config), jax.random.PRNGKey(0)))


def forward(config: ModelConfig, params: hk.Params, input_ids: jax.Array,
            attention_mask: jax.Array, *, positions: Optional[jax.Array] = None,
            cache: Optional[KVCache] = None, cache_index=0,
            cache_mask: Optional[jax.Array] = None, with_head: bool = True,
            output_slice: Optional[tuple[int, int]] = None):
    """The full model.

    Args:
      input_ids: int32 [B, T].
      attention_mask: bool/int [B, T]; False marks padding.
      positions: int32 [B, T]; default: exclusive cumsum of attention_mask (so left
        padding does not shift positions). Required with a cache after prefill.
      cache: optional KVCache (stacked or per-layer layout, returned in the same
        layout); x[:, t] is written to slot cache_index + t. Or a PrefixKVCache (returned
        as one), whose own slots cache_index + t receive x[:, t].
      cache_index: int32 scalar, the slot of the first input token.
      cache_mask: bool [B, S] over all cache slots (which slots hold real tokens,
        including the ones being written). Required with a cache. For a PrefixKVCache:
        bool [B / G, P] over the prefix slots (the own slots are all real).
      with_head: compute the LM logits.
      output_slice: None, or static ints (start, stop): return hidden states and
        logits for positions start..stop-1 only. The last layer then computes only
        those positions (its attention still reads keys and values of all T), which
        is the same result for less work. Full forwards only (no cache).

    Returns:
      (hidden float [B, T', D] in compute dtype, logits float32 [B, T', V] or None,
       new cache or None), where T' = T, or stop - start with output_slice.
    """
    if output_slice is not None:
        start, stop = (int(i) for i in output_slice)
        if not 0 <= start < stop <= input_ids.shape[1]:
            raise ValueError(f"output_slice {output_slice} is not a non-empty range within "
                             f"the {input_ids.shape[1]} input positions")
        output_slice = (start, stop)
    if positions is None:
        positions = position_ids_from_mask(attention_mask)
    if isinstance(cache, PrefixKVCache):
        groups, rows = cache.prefix_k[0].shape[0], input_ids.shape[0]
        if rows % groups or cache.k[0].shape[0] != rows:
            raise ValueError(f"PrefixKVCache: {rows} input rows must equal the own buffers' "
                             f"rows ({cache.k[0].shape[0]}) and be a multiple of the prefix "
                             f"rows ({groups})")
    if cache is None:
        key_mask = attention_mask
    elif cache_mask is None:
        raise ValueError("forward with a cache needs cache_mask [batch, cache_len]")
    else:
        key_mask = cache_mask
    if cache is None:
        return _full_forward(config)(params, input_ids, attention_mask, positions,
                                     with_head=with_head, output_slice=output_slice)
    return _transformed(config).apply(params, input_ids, attention_mask, positions, cache,
                                      cache_index, key_mask.astype(bool), with_head,
                                      output_slice)


def hidden_states(config: ModelConfig, params: hk.Params, input_ids: jax.Array,
                  attention_mask: jax.Array, positions: Optional[jax.Array] = None,
                  output_slice: Optional[tuple[int, int]] = None) -> jax.Array:
    """Final hidden states (after ln_f): compute dtype [B, T, D].

    output_slice=(start, stop) returns [B, stop - start, D] for those positions and
    skips the rest of the last layer (see `forward`).
    """
    return forward(config, params, input_ids, attention_mask, positions=positions,
                   with_head=False, output_slice=output_slice)[0]


def lm_head_logits(config: ModelConfig, params: hk.Params, hidden: jax.Array) -> jax.Array:
    """LM head on hidden states [B, T, D] -> float32 logits [B, T, V].

    Lets callers apply the head to only the positions they need (e.g. the sampler's
    last position). Temperature is the caller's: it divides these float32 logits.
    """
    if config.tie_word_embeddings:
        w = params["transformer/embed"]["embeddings"]
        return jnp.einsum("btd,vd->btv", hidden, w.astype(hidden.dtype),
                          preferred_element_type=jnp.float32)
    head = params["lm_head"]
    logits = jnp.einsum("btd,dv->btv", hidden, head["w"].astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    if config.lm_head_bias:
        logits = logits + head["b"]
    return logits


def lm_head_weights(config: ModelConfig, params: hk.Params):
    """The LM head as (weight, bias, vocab_major), in the parameters' storage dtype.

    weight is the tied embedding table [V, D] (vocab_major True) or the untied
    `lm_head/w` [D, V] (vocab_major False); bias is `lm_head/b` [V] or None.
    """
    if config.tie_word_embeddings:
        return params["transformer/embed"]["embeddings"], None, True
    head = params["lm_head"]
    return head["w"], head.get("b") if config.lm_head_bias else None, False


def lm_logits(config: ModelConfig, params: hk.Params, input_ids: jax.Array,
              attention_mask: jax.Array) -> jax.Array:
    """Next-token logits, float32 [batch, seq, vocab]. Jittable; works on sharded params."""
    return forward(config, params, input_ids, attention_mask)[1]
