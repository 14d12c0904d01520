"""FLOP accounting and model FLOP utilisation (MFU).

MFU = model FLOPs / (seconds * peak FLOP/s), where model FLOPs count only the
matmuls of the model (``transformer_flops_per_token``) and the peak is either a
datasheet number, ``measure_matmul_peak_flops`` (one square matmul) on the current
backend, or the model-shaped peak: the best rate achievable on the model's own mix of
matmul shapes (``ppo_phase_dots`` lists them, ``MatmulMixPeak`` times them before and
after each measured interval; each interval's MFU is against the samples either side
of it, and the median over intervals is the figure).
"""
from __future__ import annotations

import dataclasses
import math
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


# --------------------------------------------------------------- model-shaped peak
#
# A square 2048^3 matmul is the best case of the backend, not of the model: the
# model's dots have K = d_model, skinny decode rows, a wide LM head, small batched
# attention dots, and backward dots that contract over the token axis, and XLA runs
# each at its own rate. The peak MFU should divide by is the best rate achievable on
# the model's own mix of dots: `ppo_phase_dots` lists them (shapes and counts, from
# the ModelConfigs and the PPOConfig) and `MatmulMixPeak` times them.


@dataclasses.dataclass(frozen=True)
class Dot:
    """One matmul shape of a phase and how often the phase runs it.

    The product is [batch, m, k] @ [batch, k, n] -> [batch, m, n] (no batch axis when
    batch == 1), 2 * batch * m * k * n FLOPs per call, `count` calls per phase (a float,
    as it is computed from batch / micro-batch ratios).

    Attributes:
      name: what it is, e.g. "update/policy/mlp_in/dW" (several dots may share a shape).
      m, k, n, batch: sizes.
      count: calls per phase.
      lhs_transposed: the left operand is stored [k, m] (contracted on its first axis,
        as the weight gradient X^T @ dY contracts the token axis).
      rhs_transposed: the right operand is stored [n, k] (a tied LM head [vocab, d],
        K^T in attention scores, W^T in an input gradient).
      dtype: element dtype of both operands ("float32", "bfloat16").
    """
    name: str
    m: int
    k: int
    n: int
    batch: int = 1
    count: float = 1.0
    lhs_transposed: bool = False
    rhs_transposed: bool = False
    dtype: str = "float32"

    @property
    def flops(self) -> float:
        """FLOPs of all `count` calls."""
        return 2.0 * self.batch * self.m * self.k * self.n * self.count

    @property
    def shape_key(self) -> tuple:
        """What determines the rate: sizes, layouts and dtype (not name or count)."""
        return (self.batch, self.m, self.k, self.n, self.lhs_transposed,
                self.rhs_transposed, self.dtype)


def forward_dots(model, rows: int, tokens_per_row: int, context: int, head_tokens: int,
                 last_layer_tokens: int | None = None, count: float = 1.0,
                 name: str = "") -> list[Dot]:
    """The dots of `count` forward passes of ModelConfig `model` over `rows` rows.

    The same work as `forward_flops` (their FLOPs sum to count * rows * forward_flops(
    model, tokens_per_row, context, head_tokens, last_layer_tokens)), as shapes: per
    layer the Q, K, V and output projections and the MLP's two (gated: three) matmuls
    over all rows * tokens_per_row tokens, attention as one [tokens, head_dim] x
    [head_dim, context] and one [tokens, context] x [context, head_dim] dot per row and
    head, and the LM head on rows * head_tokens positions (its weight stored [vocab,
    d_model] when tied to the embedding). With last_layer_tokens the last layer computes
    keys and values at every position and the rest at last_layer_tokens per row.
    """
    c = model
    dt = str(c.compute_dtype)
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    prefix = f"{name}/" if name else ""
    dots: list[Dot] = []

    def layers(n_layers, queries_per_row):
        tq, tkv = rows * queries_per_row, rows * tokens_per_row
        cnt = count * n_layers

        def add(what, m, k, n, batch=1, times=1, rhs_t=False):
            dots.append(Dot(prefix + what, m, k, n, batch, cnt * times,
                            rhs_transposed=rhs_t, dtype=dt))
        add("q", tq, c.d_model, q_dim)
        add("kv", tkv, c.d_model, kv_dim, times=2)
        add("attn_out", tq, q_dim, c.d_model)
        add("mlp_in", tq, c.d_model, c.d_ff, times=2 if c.gated_mlp else 1)
        add("mlp_out", tq, c.d_ff, c.d_model)
        add("scores", queries_per_row, c.head_dim, context, batch=rows * c.n_heads, rhs_t=True)
        add("values", queries_per_row, context, c.head_dim, batch=rows * c.n_heads)

    if last_layer_tokens is None:
        layers(c.n_layers, tokens_per_row)
    else:
        if c.n_layers > 1:
            layers(c.n_layers - 1, tokens_per_row)
        layers(1, last_layer_tokens)
    if head_tokens:
        dots.append(Dot(prefix + "lm_head", rows * head_tokens, c.d_model, c.vocab_size,
                        count=count, rhs_transposed=bool(c.tie_word_embeddings), dtype=dt))
    return dots


def training_dots(dots) -> list[Dot]:
    """Forward dots plus their backward: for each [m, k] @ [k, n] the input gradient
    dY [m, n] @ W^T and the weight gradient X^T @ dY (contracting m), each with the
    forward's FLOPs, so the total is 3x the forward (as `ppo_phase_flops` counts it).
    The dots given must be forward dots (left operand not transposed)."""
    out = []
    for d in dots:
        if d.lhs_transposed:
            raise ValueError(f"training_dots takes forward dots; {d.name} has a transposed lhs")
        out.append(d)
        out.append(dataclasses.replace(d, name=d.name + "/dX", k=d.n, n=d.k,
                                       rhs_transposed=not d.rhs_transposed))
        m, n = (d.n, d.k) if d.rhs_transposed else (d.k, d.n)
        out.append(dataclasses.replace(d, name=d.name + "/dW", m=m, k=d.m, n=n,
                                       lhs_transposed=True, rhs_transposed=False))
    return out


def ppo_phase_dots(cfg, models, reward_model=None, batch_shards: int = 1) -> dict[str, list[Dot]]:
    """The dots of one PPO iteration, {"rollout": [...], "update": [...]}: the work
    `ppo_phase_flops` counts, as the shapes the compiled phases run.

    Rollout: per rollout micro-batch (ppo.rollout_micro_batch_size, 0 = the batch) the
    prompts' prefill (one per prompt, counted samples_per_prompt times as the FLOP
    count does), response_length decode steps of one token per row (attention over the
    mean context query_length + response_length // 2), and the scoring passes (policy,
    reference, critic, reward model). Update: per optimizer micro-batch
    (ppo.microbatch_size rows) the policy's (and a separate critic's) forward and
    backward, noptepochs * nminibatches * gradient_accumulation_steps times.

    Args:
      cfg: the PPOConfig; models: the run's PPOModels.
      reward_model: the reward model's ModelConfig, or None for a reward without a
        model (no reward dots).
      batch_shards: devices the batch is split over (mesh data x fsdp): rows per dot
        are per device.

    Returns:
      {"rollout": dots, "update": dots}. With batch_shards == 1 and rows that divide
      evenly (the usual case), each phase's FLOPs sum to `ppo_phase_flops`'s.
    """
    b, q, r, g = cfg.batch_size, cfg.query_length, cfg.response_length, cfg.samples_per_prompt

    def per_device(rows):
        return max(1, rows // batch_shards)

    pol = models.policy
    critic = models.critic if cfg.uses_critic else None
    micro = cfg.rollout_micro_batch_size or b
    passes = b / micro
    if micro % g == 0:  # one prefill per prompt, counted g times (as ppo_phase_flops does)
        prefill_rows, prefill_count = micro // g, passes * g
    else:
        prefill_rows, prefill_count = micro, passes
    rows = per_device(micro)
    rollout = forward_dots(pol, per_device(prefill_rows), q, q, 1, count=prefill_count,
                           name="rollout/prefill")
    rollout += forward_dots(pol, rows, 1, q + r // 2, 1, count=passes * r,
                            name="rollout/decode")
    policy_passes = 2 if cfg.recompute_rollout_logprobs or cfg.shared_trunk else 1
    rollout += forward_dots(pol, rows, q + r, q + r, r, last_layer_tokens=r,
                            count=passes * policy_passes, name="rollout/policy_and_ref")
    if critic is not None:
        rollout += forward_dots(critic, rows, q + r, q + r, 0, last_layer_tokens=r,
                                count=passes, name="rollout/critic")
    if reward_model is not None:
        rollout += forward_dots(reward_model, rows, q + r, q + r, 0, last_layer_tokens=r + 1,
                                count=passes, name="rollout/reward")
    mb = cfg.microbatch_size
    steps = cfg.noptepochs * b / mb
    update = forward_dots(pol, per_device(mb), q + r, q + r, r, last_layer_tokens=r,
                          count=steps, name="update/policy")
    if critic is not None:
        update += forward_dots(critic, per_device(mb), q + r, q + r, 0, last_layer_tokens=r,
                               count=steps, name="update/critic")
    return {"rollout": rollout, "update": training_dots(update)}


def dot_weights(dots) -> dict[tuple, float]:
    """{Dot.shape_key: share of the dots' FLOPs}; the shares sum to 1."""
    total = sum(d.flops for d in dots)
    if total <= 0:
        raise ValueError("no FLOPs in the dots given")
    weights: dict[tuple, float] = {}
    for d in dots:
        weights[d.shape_key] = weights.get(d.shape_key, 0.0) + d.flops / total
    return weights


def mix_rate(rates, weights) -> float:
    """FLOP/s of a mix of dots: 1 / sum(weight / rate), the rate at which the mix's
    FLOPs would run if every shape ran at its own measured rate (the FLOP-weighted
    harmonic mean). rates and weights are dicts on the same keys."""
    return 1.0 / sum(w / rates[key] for key, w in weights.items())


def _operand(cache, shape, dtype, seed):
    key = (shape, dtype)
    if key not in cache:
        cache[key] = jax.random.normal(jax.random.PRNGKey(seed), shape,
                                       jnp.float32).astype(dtype)
    return cache[key]


def _dot_loop(lhs_transposed: bool, rhs_transposed: bool, batched: bool):
    """jitted f(a, b, reps) -> the product, computed `reps` times in a loop. The
    operands go through an optimization barrier inside the loop so the dot is not
    hoisted out of it; one dispatch covers all repetitions (as the dots of a compiled
    phase run with no dispatch between them)."""
    from jax import lax
    off = 1 if batched else 0
    dims = (((off + (0 if lhs_transposed else 1),), (off + (1 if rhs_transposed else 0),)),
            ((0,), (0,)) if batched else ((), ()))

    def run(a, b, reps):
        out = lax.dot_general(a, b, dims)

        def body(_, carry):
            a_, b_, _out = carry
            a_, b_ = lax.optimization_barrier((a_, b_))
            return a_, b_, lax.dot_general(a_, b_, dims)
        return lax.fori_loop(1, reps, body, (a, b, out))[2]
    return jax.jit(run)


class MatmulMixPeak:
    """Peak FLOP/s of mixes of matmul shapes (e.g. a PPO phase's dots), sampled on demand.

    Each distinct shape (`Dot.shape_key`) of all mixes is compiled once as a loop of
    repetitions (enough for `min_seconds` per timed call, calibrated on the first
    call). A sample times every shape once; a mix's rate is `mix_rate` (FLOP-weighted
    harmonic mean) of its shapes' rates.

    Protocol: call `sample(rounds)` before the first measured interval (e.g. a PPO
    iteration) and after each one, in the same process (same thread pool, allocator and
    machine load as the work). Each call is one "gap" of `rounds` samples. Then
    `interval_mfu` gives each interval's MFU against the samples of the gaps on either
    side of it (take the median over intervals), and `median()` the run-wide median.
    On a machine shared with other jobs the rate both the work and the peak get moves
    with the load; the samples either side of an interval saw the load it ran under,
    so the per-interval ratio follows the work, not the load.

    Args:
      mixes: {name: dots}, e.g. `ppo_phase_dots(...)` plus {"iteration": all of them}.
      min_seconds: target length of one timed call per shape.
      seed: operand values (random normal; the values do not matter).
    """

    def __init__(self, mixes, min_seconds: float = 0.02, seed: int = 0):
        self.weights = {name: dot_weights(dots) for name, dots in mixes.items()}
        self.shapes: dict[tuple, Dot] = {}
        for dots in mixes.values():
            for d in dots:
                self.shapes.setdefault(d.shape_key, d)
        self.min_seconds = float(min_seconds)
        #: One list per `sample` call (gap) of {shape_key: FLOP/s}, one dict per round.
        self.gaps: list[list[dict[tuple, float]]] = []
        self._operands: dict = {}
        self._runs: dict = {}
        self._reps: dict[tuple, int] = {}
        self._seed = seed

    def _prepare(self, key):
        d = self.shapes[key]
        lhs = (d.k, d.m) if d.lhs_transposed else (d.m, d.k)
        rhs = (d.n, d.k) if d.rhs_transposed else (d.k, d.n)
        if d.batch > 1:
            lhs, rhs = (d.batch,) + lhs, (d.batch,) + rhs
        a = _operand(self._operands, lhs, d.dtype, self._seed)
        b = _operand(self._operands, rhs, d.dtype, self._seed + 1)
        fn = _dot_loop(d.lhs_transposed, d.rhs_transposed, d.batch > 1)
        jax.block_until_ready(fn(a, b, 1))  # compile
        start = time.perf_counter()
        jax.block_until_ready(fn(a, b, 1))
        once = max(time.perf_counter() - start, 1e-7)
        self._reps[key] = max(1, min(10_000, math.ceil(self.min_seconds / once)))
        self._runs[key] = (fn, a, b)

    def shape_rate(self, key) -> float:
        """Times one call of shape `key` (prepared on first use); FLOP/s."""
        if key not in self._runs:
            self._prepare(key)
        fn, a, b = self._runs[key]
        reps = self._reps[key]
        start = time.perf_counter()
        jax.block_until_ready(fn(a, b, reps))
        seconds = max(time.perf_counter() - start, 1e-9)
        d = self.shapes[key]
        return 2.0 * d.batch * d.m * d.k * d.n * reps / seconds

    def warm_up(self) -> None:
        """Compiles and calibrates every shape, then runs one untimed pass."""
        for key in self.shapes:
            if key not in self._runs:
                self._prepare(key)
        for key in self.shapes:
            self.shape_rate(key)

    def sample(self, rounds: int = 1) -> dict[str, float]:
        """Times every shape `rounds` times as one gap; returns the gap's {mix: FLOP/s}."""
        gap = [{key: self.shape_rate(key) for key in self.shapes} for _ in range(rounds)]
        self.gaps.append(gap)
        return self.rates(gap)

    @property
    def shape_samples(self) -> list[dict[tuple, float]]:
        """Every sample so far, {shape_key: FLOP/s} each, in order."""
        return [smp for gap in self.gaps for smp in gap]

    @property
    def samples(self) -> list[dict[str, float]]:
        """Every sample so far as {mix: FLOP/s}, in order."""
        return [{name: mix_rate(smp, w) for name, w in self.weights.items()}
                for smp in self.shape_samples]

    def rates(self, shape_samples) -> dict[str, float]:
        """{mix: FLOP/s} from each shape's median rate over `shape_samples`.

        The shapes of one sample are timed one after another; a stall (another process
        holding the cores) during one shape's timing pulls that sample's rate of every
        mix containing it down. The per-shape median drops it; the median of per-sample
        mix rates would keep the sample.
        """
        per_shape = median_samples(shape_samples)
        return {name: mix_rate(per_shape, w) for name, w in self.weights.items()}

    def median(self) -> dict[str, float]:
        """{mix: FLOP/s} over all samples taken (per-shape medians, `rates`)."""
        return self.rates(self.shape_samples)

    def around(self, i: int) -> dict[str, float]:
        """{mix: FLOP/s} from the gaps i and i + 1: the samples taken just before and just
        after the i-th measured interval."""
        return self.rates(self.gaps[i] + self.gaps[i + 1])

    def interval_mfu(self, name: str, flops: float, seconds, devices: int = 1) -> list[float]:
        """MFU of each measured interval: flops / seconds[i] / (devices * around(i)[name]).

        Args:
          name: the mix the work is made of (e.g. "update").
          flops: the work's model FLOPs per interval.
          seconds: each interval's length; interval i ran between gaps i and i + 1.
          devices: devices the work ran on (the samples are of one device).
        """
        if len(self.gaps) < len(seconds) + 1:
            raise ValueError(f"{len(seconds)} intervals need {len(seconds) + 1} gaps of "
                             f"samples, have {len(self.gaps)}")
        return [mfu(flops, secs, devices * self.around(i)[name])
                for i, secs in enumerate(seconds)]


def median_samples(samples) -> dict[str, float]:
    """{name: median over a list of {name: value} dicts}."""
    if not samples:
        raise ValueError("no samples")
    return {name: statistics.median(s[name] for s in samples) for name in samples[0]}
