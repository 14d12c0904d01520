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

Each sampler runs in its own worker process, set up as its users run it: ours
behind our entry points' malloc tuning (`pjit_ppo/cli/cpu_malloc.py`),
transformers in a plain Python process (`--transformers_malloc=tuned` gives it our
tuning too). Separate processes keep one library's heap, thread pools and caches
from slowing the other (in one process, transformers' allocations shared our
tuned heap: see docs/performance.md). The timed calls alternate between the two
workers, with `--pause_s` of idle time between calls, so that load from other
processes hits both alike.

Prints compile time (ours), then the median over `--runs` timed runs (after a
warm-up) of new tokens per second for each, and the ratio. No assertions.

    python benchmarks/sampling.py [--batch 64 --prompt 64 --new_tokens 24 --runs 5]
    python benchmarks/sampling.py --batch 64 --samples_per_prompt 4   # 256 rows
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

_READY, _TIME = "BENCH_READY", "BENCH_TIME"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _parser():
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
    parser.add_argument("--transformers_malloc", choices=("default", "tuned"), default="default",
                        help="glibc malloc of the transformers worker: as a plain Python "
                             "process has it, or with our entry points' tuning")
    parser.add_argument("--pause_s", type=float, default=0.5,
                        help="idle seconds before each timed call (the other worker's "
                             "threads stop spinning)")
    parser.add_argument("--skip_hf", action="store_true", help="time only our sampler")
    parser.add_argument("--worker", choices=("ours", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    return parser


# ------------------------------------------------------------------ workers
def _prompts(args):
    """int32 ids [batch, prompt], bool mask [batch, prompt]: left padding of varying length,
    as in PPO rollouts (at least half real)."""
    import numpy as np
    rng = np.random.RandomState(0)
    pad_id = args.vocab - 1
    ids = rng.randint(2, pad_id, (args.batch, args.prompt)).astype(np.int32)
    n_real = rng.randint(args.prompt // 2, args.prompt + 1, args.batch)
    mask = np.arange(args.prompt)[None, :] >= (args.prompt - n_real)[:, None]
    return np.where(mask, ids, pad_id), mask


def _ours(args):
    """(compile seconds, a function that samples once)."""
    import numpy as np
    import jax
    import jax.numpy as jnp

    from pjit_ppo.models import load_pretrained
    from pjit_ppo.sampling import make_generate_fn

    config, params = load_pretrained(args.workdir,
                                     config_overrides=dict(scan_unroll=args.scan_unroll))
    ids, mask = _prompts(args)
    g = args.samples_per_prompt
    fn = make_generate_fn(config, max_new_tokens=args.new_tokens,
                          temperature=args.temperature, samples_per_prompt=g)
    # Each prompt's samples in contiguous rows, as the PPO rollout lays out a group.
    j_ids, j_mask = jnp.asarray(np.repeat(ids, g, 0)), jnp.asarray(np.repeat(mask, g, 0))
    start = time.perf_counter()
    compiled = fn.lower(params, j_ids, j_mask, jax.random.PRNGKey(0)).compile()
    compile_s = time.perf_counter() - start
    key_iter = iter(range(1, 10_000))

    def call():
        jax.block_until_ready(compiled(params, j_ids, j_mask, jax.random.PRNGKey(next(key_iter))))

    label = f"ours (jax {jax.__version__}, {jax.default_backend()}, {jax.device_count()} device)"
    return label, compile_s, call


def _transformers(args):
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads or _cores())
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel.from_pretrained(args.workdir).float().eval()
    ids, mask = _prompts(args)
    t_ids = torch.tensor(ids, dtype=torch.long)
    t_mask = torch.tensor(mask, dtype=torch.long)
    g = args.samples_per_prompt

    def call():
        with torch.no_grad():
            out = model.generate(t_ids, attention_mask=t_mask, do_sample=True,
                                 temperature=args.temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, pad_token_id=args.vocab - 1,
                                 num_return_sequences=g)
        assert out.shape == (args.batch * g, args.prompt + args.new_tokens)

    label = (f"transformers {transformers.__version__} (torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads)")
    return label, None, call


def _serve(args):
    """Worker loop: set up, warm up, then one timed call per line read from stdin."""
    from pjit_ppo.cli import cpu_malloc
    label, compile_s, call = (_ours if args.worker == "ours" else _transformers)(args)
    label += f"; {cpu_malloc.describe()}"
    call()  # warm-up
    print(_READY, "" if compile_s is None else f"{compile_s:.3f}", label, sep="\t", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        call()
        print(_TIME, f"{time.perf_counter() - start:.6f}", sep="\t", flush=True)


class _Worker:
    """One benchmark worker subprocess, driven line by line."""

    def __init__(self, kind: str, argv, workdir: str, env):
        self.kind = kind
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv, "--worker", kind,
             "--workdir", workdir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env)
        fields = self._expect(_READY)
        self.compile_s = float(fields[0]) if fields[0] else None
        self.label = fields[1]

    def _expect(self, tag):
        for line in self.proc.stdout:
            if line.startswith(tag + "\t"):
                return line.rstrip("\n").split("\t")[1:]
        raise RuntimeError(f"the {self.kind} worker exited with {self.proc.wait()} "
                           f"before printing {tag}; its stderr is above")

    def time_call(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return float(self._expect(_TIME)[0])

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.worker:
        return _serve(args)

    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(
        vocab_size=args.vocab, n_embd=args.d_model, n_layer=args.layers, n_head=args.heads,
        n_positions=max(1024, args.prompt + args.new_tokens), resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=args.vocab - 1)
    g = args.samples_per_prompt
    new_tokens = args.batch * g * args.new_tokens
    print(f"model: GPT-2 arch, vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, "
          f"{args.heads} heads, fp32; batch {args.batch} prompts x {g} samples = "
          f"{args.batch * g} rows, prompt {args.prompt}, {args.new_tokens} new tokens; "
          f"{_cores()} CPU cores", flush=True)
    worker_argv = [a for a in argv if a != "--skip_hf"]
    with tempfile.TemporaryDirectory() as workdir:
        transformers.GPT2LMHeadModel(hf_config).float().save_pretrained(workdir)
        from pjit_ppo.cli import cpu_malloc
        plain_env = dict(os.environ, **{cpu_malloc.OPT_ENV: "0"})
        plain_env.pop("GLIBC_TUNABLES", None)
        tuned_env = dict(os.environ, **{cpu_malloc.OPT_ENV: "1"})
        workers = [_Worker("ours", worker_argv, workdir, tuned_env)]
        if not args.skip_hf:
            workers.append(_Worker("transformers", worker_argv, workdir,
                                   tuned_env if args.transformers_malloc == "tuned"
                                   else plain_env))
        times = {w.kind: [] for w in workers}
        try:
            for _ in range(args.runs):
                for w in workers:
                    time.sleep(args.pause_s)
                    times[w.kind].append(w.time_call())
        finally:
            for w in workers:
                w.close()

    medians = {}
    for w in workers:
        medians[w.kind] = statistics.median(times[w.kind])
        compile_part = "" if w.compile_s is None else f"compile {w.compile_s:.2f} s; "
        print(f"{w.label}: {compile_part}median {medians[w.kind] * 1e3:.1f} ms per call "
              f"-> {new_tokens / medians[w.kind]:,.0f} new tokens/s "
              f"(runs: {', '.join(f'{t:.2f}' for t in times[w.kind])} s)")
    if not args.skip_hf:
        print(f"ratio ours / transformers: {medians['transformers'] / medians['ours']:.2f}x")


if __name__ == "__main__":
    from pjit_ppo.cli import cpu_malloc
    # Before jax starts (see pjit_ppo/cli/cpu_malloc.py). A worker's environment, set by
    # the coordinator, decides whether it applies there.
    cpu_malloc.reexec_with_tuned_malloc()
    main()
