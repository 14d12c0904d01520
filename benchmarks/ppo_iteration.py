"""Seconds per PPO iteration (rollout / update split), episodes/s and MFU, per estimator.

  python benchmarks/ppo_iteration.py                 # the CPU shape of the PPO issue
  python benchmarks/ppo_iteration.py --advantage_estimator grpo   # 16 prompts x 4 samples
  python benchmarks/ppo_iteration.py --preset gpt2_124m --batch_size 512   # on a GPU
  python benchmarks/ppo_iteration.py --arch llama    # SwiGLU, RMSNorm, RoPE, untied head

Default shape ("lmhp-tiny"): GPT-2 architecture, vocab 50257, d_model 256, 4 layers,
4 heads, fp32; reward model of the same shape (and, for "gae", a separate critic from
its trunk); query 64, response 24, batch 64 episodes, 1 minibatch, 4 epochs, no
gradient accumulation. --arch llama: the same sizes as a Llama (d_ff 1024 SwiGLU,
untied LM head). The critic-free estimators sample 4 responses per prompt unless
--samples_per_prompt says otherwise. Random weights and prompts.

MFU is against the model-shaped peak (`pjit_ppo.flops.MatmulMixPeak` on
`ppo_phase_dots`): the best rate of this run's own matmul shapes, each phase's dots
weighted by their share of its FLOPs, sampled (--peak_rounds times) before the first
timed iteration and after each one, in this process. The MFU line is each iteration
against the samples either side of it, median over iterations; the run's median peak,
the MFU against it, and against a square 2048^3 matmul sampled alongside are printed
for reference. Dated measurements are in docs/performance.md.
"""
import argparse
import json
import statistics
import sys
import time

from pjit_ppo.cli import cpu_malloc

if __name__ == "__main__":  # before jax starts: see pjit_ppo/cli/cpu_malloc.py
    cpu_malloc.reexec_with_tuned_malloc()

import jax  # noqa: E402

from pjit_ppo import flops  # noqa: E402
from pjit_ppo.config import MeshConfig, ModelOptions, PPOConfig, RewardOptions, RunConfig  # noqa: E402,E501
from pjit_ppo.ppo import run  # noqa: E402

PRESETS = {  # d_model, layers, heads (d_ff = 4 d_model)
    "cpu_small": (256, 4, 4),
    "gpt2_124m": (768, 12, 12),
}


def random_model(arch: str, preset: str) -> dict:
    """The HF config dict of the random policy (and reward model)."""
    d, layers, heads = PRESETS[preset]
    if arch == "llama":
        return dict(model_type="llama", vocab_size=50257, hidden_size=d,
                    num_hidden_layers=layers, num_attention_heads=heads,
                    intermediate_size=4 * d, max_position_embeddings=1024,
                    tie_word_embeddings=False)
    return dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=d,
                n_layer=layers, n_head=heads)


def samples_per_prompt(args) -> int:
    if args.samples_per_prompt:
        return args.samples_per_prompt
    return 1 if args.advantage_estimator == "gae" else 4


def make_config(args) -> RunConfig:
    return RunConfig(
        model=ModelOptions(
            random=random_model(args.arch, args.preset),
            compute_dtype=args.dtype, remat_policy=args.remat_policy,
            scan_unroll=args.scan_unroll or PRESETS[args.preset][1]),
        reward=RewardOptions(kind="model"),
        ppo=PPOConfig(query_length=64, response_length=24, batch_size=args.batch_size,
                      nminibatches=1, noptepochs=4, gradient_accumulation_steps=args.grad_accum,
                      total_episodes=args.batch_size * 1000, critic_init="reward",
                      pad_token_id=50256, advantage_estimator=args.advantage_estimator,
                      samples_per_prompt=samples_per_prompt(args),
                      recompute_rollout_logprobs=bool(args.recompute_rollout_logprobs)),
        mesh=MeshConfig(data=args.mesh_data, fsdp=args.mesh_fsdp, tensor=1),
        measure_peak=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="gpt2", choices=("gpt2", "llama"))
    p.add_argument("--preset", default="cpu_small", choices=sorted(PRESETS))
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--remat_policy", default="none")
    p.add_argument("--scan_unroll", type=int, default=0,
                   help="layers per scan step; 0 = all layers (fastest on CPU here)")
    p.add_argument("--iterations", type=int, default=5, help="timed iterations after warm-up")
    p.add_argument("--mesh_data", type=int, default=1, help="data-parallel mesh axis size")
    p.add_argument("--mesh_fsdp", type=int, default=-1,
                   help="FSDP mesh axis size; -1 = the remaining devices")
    p.add_argument("--advantage_estimator", default="gae",
                   choices=("gae", "grpo", "rloo", "reinforce_pp"))
    p.add_argument("--samples_per_prompt", type=int, default=0,
                   help="responses per prompt; 0 = 1 for gae, 4 for the critic-free ones")
    p.add_argument("--recompute_rollout_logprobs", type=int, default=1, choices=(0, 1),
                   help="1 (the default config): the rollout recomputes the policy's log-probs "
                        "with a full forward; 0: it keeps the sampler's, as TRL's PPOTrainer "
                        "does (one policy pass less)")
    p.add_argument("--peak_rounds", type=int, default=2,
                   help="model-shaped peak samples before the first timed iteration and "
                        "after each one")
    p.add_argument("--json", default="", help="also write the timings and peak samples here")
    args = p.parse_args()

    config = make_config(args)
    t0 = time.perf_counter()
    job = run.build(config)  # prompts: batch_size // samples_per_prompt rows per iteration
    trainer, state, frozen, prompts = job.trainer, job.state, job.frozen, job.prompts
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    q, m = prompts(0)
    state, first = trainer.step(state, frozen, q, m, 0)  # compiles both phases
    warm_s = time.perf_counter() - t0

    peak = model_shaped_peak(trainer)
    t0 = time.perf_counter()
    peak.warm_up()  # compiles the dots
    peak_setup_s = time.perf_counter() - t0
    peak.sample(args.peak_rounds)  # before the first timed iteration, then after each one
    rows = []
    for it in range(1, args.iterations + 1):
        q, m = prompts(it)
        state, metrics = trainer.step(state, frozen, q, m, it)
        rows.append(metrics)
        peak.sample(args.peak_rounds)
    report(args, config, trainer, state, first, rows, peak, build_s, warm_s, peak_setup_s)


def model_shaped_peak(trainer) -> flops.MatmulMixPeak:
    """Rollout, update and iteration mixes of the run's dots, and the square reference.

    The benchmark's reward model is a random model of the policy's shape."""
    phases = flops.ppo_phase_dots(trainer.cfg, trainer.models,
                                  reward_model=trainer.models.policy,
                                  batch_shards=jax.device_count())
    if jax.device_count() == 1:  # the dots are the work the FLOP count counts
        for phase, dots in phases.items():
            got, want = sum(d.flops for d in dots), trainer.flops[phase]
            assert abs(got - want) <= 1e-9 * want, (phase, got, want)
    return flops.MatmulMixPeak({
        **phases, "iteration": phases["rollout"] + phases["update"],
        "square_2048": [flops.Dot("square", 2048, 2048, 2048)]})


def report(args, config, trainer, state, first, rows, peak, build_s, warm_s, peak_setup_s):
    ppo = config.ppo
    devices = jax.device_count()

    def med(key):
        return statistics.median(r[key] for r in rows)

    rollout_s, update_s = med("time/rollout_s"), med("time/update_s")
    it_s = med("time/iteration_s")
    work = {"rollout": trainer.flops["rollout"], "update": trainer.flops["update"]}
    work["iteration"] = work["rollout"] + work["update"]
    secs = {"rollout": rollout_s, "update": update_s, "iteration": it_s}
    peaks = {k: v * devices for k, v in peak.median().items()}
    print(f"estimator: {ppo.advantage_estimator}  samples_per_prompt: {ppo.samples_per_prompt} "
          f"recompute_rollout_logprobs: {ppo.recompute_rollout_logprobs} "
          f"({ppo.prompts_per_iteration} prompts)  trainable: {sorted(state.params)}")
    print(f"shape: arch={args.arch} preset={args.preset} batch={args.batch_size} query=64 "
          f"response=24 epochs=4 minibatches=1 grad_accum={args.grad_accum} dtype={args.dtype} "
          f"remat={args.remat_policy} unroll={config.model.scan_unroll} "
          f"devices={devices} ({jax.devices()[0].platform})")
    print(f"host malloc: {cpu_malloc.describe()}")
    print(f"build_s: {build_s:.1f}  compile_s: {first['time/compile_s']:.1f}  "
          f"first_iteration_s (incl. compile): {warm_s:.1f}  "
          f"peak setup_s: {peak_setup_s:.1f} ({len(peak.shapes)} dot shapes)")
    for key in ("iteration_s", "rollout_s", "update_s"):
        print(f"{key} (all): " + ", ".join(f"{r['time/' + key]:.2f}" for r in rows))
    print(f"median iteration_s: {it_s:.2f}  rollout_s: {rollout_s:.2f}  update_s: {update_s:.2f}"
          f"  rollout share: {rollout_s / it_s:.2f}")
    print(f"episodes_per_s: {args.batch_size / it_s:.2f}")
    print(f"model TFLOP per iteration: rollout {work['rollout'] / 1e12:.3f}, "
          f"update {work['update'] / 1e12:.3f}")
    for name in ("rollout", "update", "iteration", "square_2048"):
        values = [smp[name] * devices / 1e9 for smp in peak.samples]
        print(f"{name} peak GFLOP/s: {peaks[name] / 1e9:.1f} (median of {len(values)} "
              f"samples; each: " + ", ".join(f"{v:.0f}" for v in values) + ")")
    # The figure: each iteration against the peak samples taken just before and after it
    # (the machine's load then), median over the iterations.
    per_it = {k: peak.interval_mfu(k, work[k], [r[f"time/{k}_s"] for r in rows], devices)
              for k in work}
    print("MFU: " + "  ".join(f"{k} {statistics.median(v):.3f}" for k, v in per_it.items())
          + "  (each iteration against the model-shaped peak sampled either side of it; "
          "median over iterations)")
    print("MFU per iteration: " + "  ".join(
        f"{k} " + ",".join(f"{v:.3f}" for v in vs) for k, vs in per_it.items()))
    print("MFU against the run's median peak: " + "  ".join(
        f"{k} {flops.mfu(work[k], secs[k], peaks[k]):.3f}" for k in work))
    print("MFU against the square-matmul peak (reference): " + "  ".join(
        f"{k} {flops.mfu(work[k], secs[k], peaks['square_2048']):.3f}" for k in work))
    if args.json:
        times = [{k: r[f"time/{k}_s"] for k in secs} for r in rows]
        shape_samples = [[[list(key), v] for key, v in smp.items()]
                         for smp in peak.shape_samples]
        weights = {n: [[list(key), v] for key, v in w.items()] for n, w in peak.weights.items()}
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "peak_rounds": args.peak_rounds, "devices": devices,
                       "flops": work, "seconds": times, "mfu": per_it,
                       "peak_samples": peak.samples, "shape_samples": shape_samples,
                       "weights": weights}, f, indent=1)


if __name__ == "__main__":
    main()
