"""Seconds per PPO iteration (rollout / update split), episodes/s and MFU, per estimator.

  python benchmarks/ppo_iteration.py                 # the CPU shape of the PPO issue
  python benchmarks/ppo_iteration.py --advantage_estimator grpo   # 16 prompts x 4 samples
  python benchmarks/ppo_iteration.py --preset gpt2_124m --batch_size 512   # on a GPU

Default shape: GPT-2 architecture, vocab 50257, d_model 256, 4 layers, 4 heads,
fp32; reward model of the same shape (and, for "gae", a separate critic from its
trunk); query 64, response 24, batch 64 episodes, 1 minibatch, 4 epochs, no
gradient accumulation. The critic-free estimators sample 4 responses per prompt
unless --samples_per_prompt says otherwise. Random weights and prompts. MFU is
against a square-matmul peak measured in the same run. Dated measurements are in
docs/performance.md.
"""
import argparse
import statistics
import time

from pjit_ppo.cli import cpu_malloc

if __name__ == "__main__":  # before jax starts: see pjit_ppo/cli/cpu_malloc.py
    cpu_malloc.reexec_with_tuned_malloc()

import jax  # noqa: E402

from pjit_ppo import flops  # noqa: E402
from pjit_ppo.config import MeshConfig, ModelOptions, PPOConfig, RewardOptions, RunConfig  # noqa: E402,E501
from pjit_ppo.ppo import run  # noqa: E402

PRESETS = {
    "cpu_small": dict(n_embd=256, n_layer=4, n_head=4),
    "gpt2_124m": dict(n_embd=768, n_layer=12, n_head=12),
}


def samples_per_prompt(args) -> int:
    if args.samples_per_prompt:
        return args.samples_per_prompt
    return 1 if args.advantage_estimator == "gae" else 4


def make_config(args) -> RunConfig:
    return RunConfig(
        model=ModelOptions(
            random=dict(model_type="gpt2", vocab_size=50257, n_positions=1024,
                        **PRESETS[args.preset]),
            compute_dtype=args.dtype, remat_policy=args.remat_policy,
            scan_unroll=args.scan_unroll or PRESETS[args.preset]["n_layer"]),
        reward=RewardOptions(kind="model"),
        ppo=PPOConfig(query_length=64, response_length=24, batch_size=args.batch_size,
                      nminibatches=1, noptepochs=4, gradient_accumulation_steps=args.grad_accum,
                      total_episodes=args.batch_size * 1000, critic_init="reward",
                      pad_token_id=50256, advantage_estimator=args.advantage_estimator,
                      samples_per_prompt=samples_per_prompt(args)),
        mesh=MeshConfig(data=args.mesh_data, fsdp=args.mesh_fsdp, tensor=1),
        measure_peak=False)


def main():
    p = argparse.ArgumentParser()
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
    args = p.parse_args()

    config = make_config(args)
    t0 = time.perf_counter()
    job = run.build(config)  # prompts: batch_size // samples_per_prompt rows per iteration
    trainer, state, frozen, prompts = job.trainer, job.state, job.frozen, job.prompts
    ppo = config.ppo
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    q, m = prompts(0)
    state, first = trainer.step(state, frozen, q, m, 0)  # compiles both phases
    warm_s = time.perf_counter() - t0
    rows = []
    for it in range(1, args.iterations + 1):
        q, m = prompts(it)
        state, metrics = trainer.step(state, frozen, q, m, it)
        rows.append(metrics)
    peak = flops.measure_matmul_peak_flops(n=2048) * jax.device_count()

    def med(key):
        return statistics.median(r[key] for r in rows)

    rollout_s, update_s = med("time/rollout_s"), med("time/update_s")
    it_s = med("time/iteration_s")
    print(f"estimator: {ppo.advantage_estimator}  samples_per_prompt: {ppo.samples_per_prompt} "
          f"({ppo.prompts_per_iteration} prompts)  trainable: {sorted(state.params)}")
    print(f"shape: preset={args.preset} batch={args.batch_size} query=64 response=24 "
          f"epochs=4 minibatches=1 grad_accum={args.grad_accum} dtype={args.dtype} "
          f"remat={args.remat_policy} unroll={config.model.scan_unroll} "
          f"devices={jax.device_count()} "
          f"({jax.devices()[0].platform})")
    print(f"host malloc: {cpu_malloc.describe()}")
    print(f"build_s: {build_s:.1f}  compile_s: {first['time/compile_s']:.1f}  "
          f"first_iteration_s (incl. compile): {warm_s:.1f}")
    print("iteration_s (all): " + ", ".join(f"{r['time/iteration_s']:.2f}" for r in rows))
    print(f"median iteration_s: {it_s:.2f}  rollout_s: {rollout_s:.2f}  update_s: {update_s:.2f}"
          f"  rollout share: {rollout_s / it_s:.2f}")
    print(f"episodes_per_s: {args.batch_size / it_s:.2f}")
    print(f"model TFLOP per iteration: rollout {trainer.flops['rollout'] / 1e12:.3f}, "
          f"update {trainer.flops['update'] / 1e12:.3f}")
    print(f"matmul peak (measured now): {peak / 1e9:.1f} GFLOP/s")
    total = trainer.flops["rollout"] + trainer.flops["update"]
    print(f"rollout MFU: {trainer.flops['rollout'] / rollout_s / peak:.3f}  "
          f"update MFU: {trainer.flops['update'] / update_s / peak:.3f}  "
          f"iteration MFU: {total / it_s / peak:.3f}")


if __name__ == "__main__":
    main()
