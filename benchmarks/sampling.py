"""Sampling throughput: our KV-cache sampler vs transformers' `generate` (torch, CPU).

Both run the same random-weight GPT-2-architecture model (vocab 50257, d_model
256, 4 layers, 4 heads, fp32): it is built in torch, saved with
`save_pretrained` to a temporary directory and loaded into ours with
`pjit_ppo.models.load_pretrained`. Sampling follows the reference recipe:
temperature 0.7, no top-k / top-p, exactly `new_tokens` tokens per row.

With `--samples_per_prompt G`, each of the `--batch` prompts is sampled G times
(batch x G rows): ours repeats the prompt rows as the PPO rollout does (and, as
there, prefills each prompt once: `samples_per_prompt=G`), and transformers gets
`num_return_sequences=G`.

Prints compile time (ours), then the median over `--runs` timed runs (after a
warm-up) of new tokens per second for each, and the ratio. No assertions.

    python benchmarks/sampling.py [--batch 64 --prompt 64 --new_tokens 24 --runs 5]
    python benchmarks/sampling.py --batch 64 --samples_per_prompt 4   # 256 rows
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _median_time(fn, runs: int) -> float:
    """Median wall time of `runs` calls of fn()."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="prompts")
    parser.add_argument("--samples_per_prompt", type=int, default=1,
                        help="responses per prompt (rows = batch x samples_per_prompt)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=24)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--torch_threads", type=int, default=0,
                        help="torch intra-op threads (0 = the CPU cores this process may use)")
    parser.add_argument("--scan_unroll", type=int, default=1,
                        help="layers per scan step in our decoder (layers = unrolled)")
    parser.add_argument("--skip_hf", action="store_true", help="time only our sampler")
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    import transformers
    import jax
    import jax.numpy as jnp

    from pjit_ppo.models import load_pretrained
    from pjit_ppo.sampling import make_generate_fn

    cores = _cores()
    torch.set_num_threads(args.torch_threads or cores)
    torch.manual_seed(0)
    pad_id = args.vocab - 1
    hf_config = transformers.GPT2Config(
        vocab_size=args.vocab, n_embd=args.d_model, n_layer=args.layers, n_head=args.heads,
        n_positions=max(1024, args.prompt + args.new_tokens), resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=pad_id)
    model = transformers.GPT2LMHeadModel(hf_config).float().eval()

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        config, params = load_pretrained(
            tmp, config_overrides=dict(scan_unroll=args.scan_unroll))

    rng = np.random.RandomState(0)
    ids = rng.randint(2, pad_id, (args.batch, args.prompt)).astype(np.int32)
    # Left padding of varying length, as in PPO rollouts (at least half real).
    n_real = rng.randint(args.prompt // 2, args.prompt + 1, args.batch)
    mask = np.arange(args.prompt)[None, :] >= (args.prompt - n_real)[:, None]
    ids = np.where(mask, ids, pad_id)
    g = args.samples_per_prompt
    new_tokens = args.batch * g * args.new_tokens
    print(f"model: GPT-2 arch, vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, "
          f"{args.heads} heads, fp32; batch {args.batch} prompts x {g} samples = "
          f"{args.batch * g} rows, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens; {cores} CPU cores; jax backend "
          f"{jax.default_backend()} ({jax.device_count()} device(s))")

    # ---- ours
    fn = make_generate_fn(config, max_new_tokens=args.new_tokens,
                          temperature=args.temperature, samples_per_prompt=g)
    # Each prompt's samples in contiguous rows, as the PPO rollout lays out a group.
    j_ids, j_mask = jnp.asarray(np.repeat(ids, g, 0)), jnp.asarray(np.repeat(mask, g, 0))
    start = time.perf_counter()
    compiled = fn.lower(params, j_ids, j_mask, jax.random.PRNGKey(0)).compile()
    compile_s = time.perf_counter() - start
    key_iter = iter(range(1, 10_000))

    def ours():
        jax.block_until_ready(compiled(params, j_ids, j_mask, jax.random.PRNGKey(next(key_iter))))

    ours()  # warm-up
    if args.skip_hf:
        ours_s = _median_time(ours, args.runs)
        print(f"ours:  compile {compile_s:.2f} s; median {ours_s * 1e3:.1f} ms per call "
              f"-> {new_tokens / ours_s:,.0f} new tokens/s")
        return

    # ---- transformers
    t_ids = torch.tensor(ids, dtype=torch.long)
    t_mask = torch.tensor(mask, dtype=torch.long)

    def theirs():
        with torch.no_grad():
            out = model.generate(t_ids, attention_mask=t_mask, do_sample=True,
                                 temperature=args.temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, pad_token_id=pad_id,
                                 num_return_sequences=g)
        assert out.shape == (args.batch * g, args.prompt + args.new_tokens)

    theirs()  # warm-up
    # Interleave the timed runs so that load from other processes hits both alike.
    ours_times, theirs_times = [], []
    for _ in range(args.runs):
        for call, times in ((ours, ours_times), (theirs, theirs_times)):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    ours_s, theirs_s = statistics.median(ours_times), statistics.median(theirs_times)
    ours_tps, theirs_tps = new_tokens / ours_s, new_tokens / theirs_s
    print(f"ours (jax {jax.__version__}): compile {compile_s:.2f} s; median {ours_s * 1e3:.1f} "
          f"ms per call -> {ours_tps:,.0f} new tokens/s")
    print(f"transformers {transformers.__version__} (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads): median {theirs_s * 1e3:.1f} ms per call "
          f"-> {theirs_tps:,.0f} new tokens/s")
    print(f"ratio ours / transformers: {ours_tps / theirs_tps:.2f}x")


if __name__ == "__main__":
    from pjit_ppo.cli import cpu_malloc
    cpu_malloc.reexec_with_tuned_malloc()  # before jax starts: see pjit_ppo/cli/cpu_malloc.py
    main()
