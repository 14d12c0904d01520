"""Forward+backward throughput of the decoder on this machine, with MFU.

  python benchmarks/forward_backward.py [--d_model 512 --n_layers 6 ...]

Prints tokens/s of one jitted value_and_grad of the LM cross-entropy, and the
model FLOP utilisation against a square-matmul peak measured in the same run
(so the ratio does not depend on how busy the machine is today). Medians of
several timed runs after a warm-up; compile time is reported separately.
"""
import argparse
import statistics
import time

from pjit_ppo.cli import cpu_malloc

if __name__ == "__main__":  # before jax starts: see pjit_ppo/cli/cpu_malloc.py
    cpu_malloc.reexec_with_tuned_malloc()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pjit_ppo import flops  # noqa: E402
from pjit_ppo.models import ModelConfig, init_params, lm_logits  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--architecture", default="gpt2")
    p.add_argument("--vocab_size", type=int, default=32000)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--n_layers", type=int, default=6)
    p.add_argument("--n_heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--remat_policy", default="none")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    hf = dict(model_type=args.architecture, vocab_size=args.vocab_size, n_embd=args.d_model,
              n_layer=args.n_layers, n_head=args.n_heads, n_positions=max(1024, args.seq))
    config = ModelConfig.from_hf_dict(hf, compute_dtype=args.dtype,
                                      remat_policy=args.remat_policy)
    params = init_params(config, jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.seq), 0, args.vocab_size)
    mask = jnp.ones_like(ids, bool)

    def loss(params, ids, mask):
        logits = lm_logits(config, params, ids, mask)[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    step = jax.jit(jax.value_and_grad(loss))
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, ids, mask))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, ids, mask))
        times.append(time.perf_counter() - t0)
    secs = statistics.median(times)

    peak = flops.measure_matmul_peak_flops(n=2048)
    c = config
    fwd_per_token = flops.transformer_flops_per_token(
        c.n_layers, c.d_model, c.n_heads, c.head_dim, c.d_ff, c.vocab_size, args.seq,
        gated_mlp=c.gated_mlp, n_kv_heads=c.n_kv_heads, lm_head=True)
    tokens = args.batch * args.seq
    model_flops = 3.0 * fwd_per_token * tokens
    print(f"config: {args.architecture} d_model={c.d_model} layers={c.n_layers} "
          f"heads={c.n_heads} vocab={c.vocab_size} batch={args.batch} seq={args.seq} "
          f"dtype={args.dtype} remat={args.remat_policy} params={c.num_params / 1e6:.1f}M")
    print(f"compile_s: {compile_s:.2f}")
    print(f"step_s (median of {args.repeats}): {secs:.4f}  (all: "
          + ", ".join(f"{t:.4f}" for t in times) + ")")
    print(f"tokens_per_s: {tokens / secs:.0f}")
    print(f"model_tflop_per_step: {model_flops / 1e12:.4f}")
    print(f"achieved_gflops: {model_flops / secs / 1e9:.1f}")
    print(f"matmul_peak_gflops (measured now, {jax.devices()[0].platform}): {peak / 1e9:.1f}")
    print(f"mfu: {model_flops / secs / peak:.3f}")


if __name__ == "__main__":
    main()
