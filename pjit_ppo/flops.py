"""FLOP accounting and model FLOP utilisation (MFU).

MFU = model FLOPs / (seconds * peak FLOP/s), where model FLOPs count only the
matmuls of the model (``transformer_flops_per_token``) and the peak is either a
datasheet number or ``measure_matmul_peak_flops`` on the current backend.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def measure_matmul_peak_flops(n: int = 2048, dtype=jnp.float32,
                              repeats: int = 5,
                              calls_per_repeat: int = 4) -> float:
    """Measures the achieved FLOP/s of a jitted square matmul.

    Each timed run dispatches ``calls_per_repeat`` independent [n, n] @ [n, n]
    matmuls back to back and waits for all of them, which hides per-call
    dispatch latency for small n. The result is 2 * n^3 * calls_per_repeat
    over the median time of ``repeats`` runs, after one warm-up run that also
    compiles. Uses the default backend and jax's default matmul precision for
    ``dtype`` (on GPUs float32 may run on TF32 tensor cores).

    Args:
      n: matrix size.
      dtype: element dtype, e.g. jnp.float32 or jnp.bfloat16.
      repeats: number of timed runs.
      calls_per_repeat: matmuls per timed run.

    Returns:
      float FLOP/s (positive, finite).
    """
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(key_b, (n, n), jnp.float32).astype(dtype)
    matmul = jax.jit(jnp.matmul)

    def run():
        outs = [matmul(a, b) for _ in range(calls_per_repeat)]
        jax.block_until_ready(outs)

    run()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    seconds = max(statistics.median(times), 1e-9)
    return 2.0 * n ** 3 * calls_per_repeat / seconds


def transformer_flops_per_token(n_layers: int, d_model: int, n_heads: int,
                                head_dim: int, d_ff: int, vocab_size: int,
                                seq_len: int, gated_mlp: bool = False,
                                n_kv_heads: int | None = None,
                                lm_head: bool = True) -> float:
    """Forward-pass matmul FLOPs per token of a decoder-only transformer.

    A matmul [m, k] @ [k, n] counts 2 * m * k * n FLOPs. Per token and layer,
    with q = n_heads * head_dim and kv = n_kv_heads * head_dim:

      attention projections  2 * d_model * (q + 2 * kv)   (Q, K, V)
                           + 2 * q * d_model              (output)
      attention scores       2 * q * seq_len              (Q K^T)
      attention values       2 * q * seq_len              (softmax(.) V)
      MLP                    2 * d_model * d_ff * (3 if gated_mlp else 2)

    plus 2 * d_model * vocab_size for the LM head when lm_head. Embedding
    lookups, norms, biases, softmax and activations are not counted (they are
    a small fraction). The attention terms count every one of the seq_len keys
    a query is scored against, as a dense masked implementation computes them:
    a causal pass over a sequence does about twice the work it strictly needs,
    and a decoding step with a KV cache of length S uses seq_len = S. Training
    (forward + backward) costs about 3x this.

    Args:
      n_layers, d_model, n_heads, head_dim, d_ff, vocab_size: model shape.
      seq_len: number of keys each query attends over.
      gated_mlp: True for a gated MLP (three d_model x d_ff matrices).
      n_kv_heads: key/value heads (grouped-query attention); None = n_heads.
      lm_head: whether to count the output projection to the vocabulary.

    Returns:
      float FLOPs per token.
    """
    if n_kv_heads is None:
        n_kv_heads = n_heads
    q_dim = n_heads * head_dim
    kv_dim = n_kv_heads * head_dim
    projections = 2 * d_model * (q_dim + 2 * kv_dim) + 2 * q_dim * d_model
    attention = 2 * 2 * q_dim * seq_len
    mlp = 2 * d_model * d_ff * (3 if gated_mlp else 2)
    total = n_layers * (projections + attention + mlp)
    if lm_head:
        total += 2 * d_model * vocab_size
    return float(total)


def kv_projection_flops_per_token(d_model: int, head_dim: int, n_kv_heads: int) -> float:
    """Key and value projection FLOPs of one token in one layer: 2 * d_model * 2 * kv.

    The part of a layer a position still costs when it is only attended to (its
    query, attention output and MLP are not computed), as in a last layer that
    computes only some positions.
    """
    return float(2 * d_model * 2 * n_kv_heads * head_dim)


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOP utilisation: flops / seconds / peak (a fraction, not %).

    Args:
      flops: model FLOPs done in the interval.
      seconds: wall-clock length of the interval.
      peak: peak FLOP/s of the hardware used (summed over its devices).

    Returns:
      float; 0.0 when seconds or peak is not positive.
    """
    if seconds <= 0 or peak <= 0:
        return 0.0
    return float(flops) / float(seconds) / float(peak)


def forward_flops(model, tokens_per_row: int, context: int, head_tokens: int,
                  last_layer_tokens: int | None = None) -> float:
    """Forward FLOPs of one row of a ModelConfig `model`.

    The trunk runs over `tokens_per_row` tokens attending over `context` keys; the
    LM head runs on `head_tokens` of them.

    Args:
      model: a ModelConfig (sizes are read from it).
      tokens_per_row: tokens the trunk processes.
      context: keys each query attends over (see `transformer_flops_per_token`).
      head_tokens: positions the LM head is applied to (0 for a scalar-head model).
      last_layer_tokens: how many positions the last layer computes in full (scoring
        passes use `output_slice`); the other positions only need its key and value
        projections. None = all of them.

    Returns:
      float FLOPs.
    """
    c = model
    per_layer = transformer_flops_per_token(
        1, c.d_model, c.n_heads, c.head_dim, c.d_ff, c.vocab_size, context,
        gated_mlp=c.gated_mlp, n_kv_heads=c.n_kv_heads, lm_head=False)
    trunk = c.n_layers * per_layer * tokens_per_row
    if last_layer_tokens is not None:
        kv_only = kv_projection_flops_per_token(c.d_model, c.head_dim, c.n_kv_heads)
        trunk -= (per_layer - kv_only) * (tokens_per_row - last_layer_tokens)
    return trunk + 2.0 * c.d_model * c.vocab_size * head_tokens


def ppo_phase_flops(cfg, models, reward_flops: float = 0.0) -> dict[str, float]:
    """Model FLOPs of one PPO iteration: {"rollout": ..., "update": ...} (global batch).

    Counts matmul and attention FLOPs (2 per multiply-add) of the work done: the
    scoring passes' last layer only at the positions they read (R for logprobs and
    values, R + 1 for the reward). The backward pass is counted as twice the
    forward; recomputation from remat is not counted (MFU counts useful work only).
    Every one of the batch_size episodes is sampled and scored in full, also when
    several share a prompt (ppo.samples_per_prompt). A critic is counted only when the
    estimator trains one (`cfg.uses_critic`) and it is separate (`models.critic`).

    Args:
      cfg: the PPOConfig; models: the run's PPOModels (policy and critic configs);
      reward_flops: forward FLOPs of scoring one episode with the run's reward (its
        kind's `flops`, `pjit_ppo.rewards`: a reward model's forward pass, 0 for a
        function of tokens).
    """
    b, q, r = cfg.batch_size, cfg.query_length, cfg.response_length
    pol = models.policy
    sample = forward_flops(pol, q, q, 1) + forward_flops(pol, r, q + r // 2, r)
    policy_fwd = forward_flops(pol, q + r, q + r, r, last_layer_tokens=r)
    critic_fwd = (0.0 if models.critic is None or not cfg.uses_critic else
                  forward_flops(models.critic, q + r, q + r, 0, last_layer_tokens=r))
    rollout_f = sample + 2 * policy_fwd + critic_fwd + reward_flops
    if not cfg.recompute_rollout_logprobs and not cfg.shared_trunk:
        rollout_f -= policy_fwd
    update_f = 3.0 * cfg.noptepochs * (policy_fwd + critic_fwd)
    return {"rollout": b * rollout_f, "update": b * update_f}
