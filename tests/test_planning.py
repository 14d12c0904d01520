"""The memory planner, rollout micro-batching, the plan a run logs, and profiling.

The planner assembles a run with the very code the real build runs (on abstract shapes):
for every reward kind and every estimator layout, its trees, shapes, dtypes, shardings
and argument bytes equal those the build allocates (no compile needed for that).

The planner's per-device figures are checked against what the compiled programs
actually hold on CPU: the bytes of every live buffer on device 0 (arguments, outputs
and the resident state), within TOLERANCE. XLA's temporary bytes cannot be observed
on CPU (the CPU client reports no memory stats); they are checked to be those of the
very programs the trainer runs (same figures from the abstract and the real build).
"""
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runs
from pjit_ppo import memory_analysis, planning, rewards
from pjit_ppo.config import ModelOptions, PPOConfig, RewardOptions, RunConfig
from pjit_ppo.config.estimators import ESTIMATORS
from pjit_ppo.models import lora
from pjit_ppo.ppo import memory_plan
from pjit_ppo.ppo import run as run_lib
from pjit_ppo.ppo.trainer import PPOTrainer

#: Relative tolerance between the planner's bytes and the bytes actually live on a
#: device (plus a few KiB for scalars and keys the figures round differently).
TOLERANCE = 0.01
SLACK = 4096


def tiny_config(**ppo) -> RunConfig:
    """A tiny GPT-2 policy, a separate critic from a tiny reward model (so both frozen
    models exist), 8 fake devices (fsdp)."""
    hf = dict(model_type="gpt2", vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=64,
              activation_function="gelu_new")
    base = dict(query_length=8, response_length=8, batch_size=32, nminibatches=2, noptepochs=1,
                total_episodes=64, temperature=1.0, truncate_token=None, truncate_after=0,
                critic_init="reward", pad_token_id=63)
    base.update(ppo)
    return RunConfig(model=ModelOptions(random=hf), reward=RewardOptions(kind="model"),
                     ppo=PPOConfig(**base), num_iterations=1, measure_peak=False)


def bytes_on(tree, device) -> int:
    """Bytes of the shards of `tree`'s arrays that live on `device`."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == device)


def copy(tree):
    """New buffers with the same shardings (the fixture's state must outlive a donation)."""
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(tree)


def close(planned: int, actual: int) -> bool:
    return abs(planned - actual) <= TOLERANCE * max(actual, 1) + SLACK


@pytest.fixture(scope="module")
def job_and_plan():
    config = tiny_config()
    abstract = planning.plan(config)
    job = run_lib.build(config)
    real = run_lib.log_memory_plan(job, job.state)
    return config, job, abstract, real


def test_plan_equals_allocation(job_and_plan):
    config, job, abstract, real = job_and_plan
    dev = jax.devices()[0]
    # The abstract build compiles exactly the programs the trainer runs.
    for phase in planning.PHASES:
        for key in planning.XLA_KEYS + ("peak_bytes",):
            assert abstract["phases"][phase][key] == real["phases"][phase][key], (phase, key)
    # Resident state: parameters, both Adam moments and the frozen models, as allocated.
    state, frozen = job.state, job.frozen
    resident = bytes_on((state.params, state.opt_state, frozen), dev)
    assert close(abstract["resident_bytes"], resident), (abstract["resident_bytes"], resident)
    assert resident > 0

    # Rollout: its arguments and outputs as they are on the device.
    trainer = job.trainer
    query, mask = job.prompts(0)
    rollout = abstract["phases"]["rollout"]
    args = bytes_on((state.params, frozen, state.kl_coef, query, mask), dev)
    assert close(rollout["argument_bytes"], args), (rollout["argument_bytes"], args)
    batch, metrics = trainer.rollout(state, frozen, query, mask, 0)
    outputs = bytes_on((batch, metrics), dev)
    assert close(rollout["output_bytes"], outputs), (rollout["output_bytes"], outputs)
    # Everything resident during the rollout is counted in its peak.
    live = bytes_on((state, frozen, query, mask, batch, metrics), dev)
    assert rollout["peak_bytes"] >= live - SLACK
    assert rollout["resident_elsewhere_bytes"]["optimizer_state"] == bytes_on(state.opt_state,
                                                                              dev)

    # Update: arguments = train state + rollout batch; the state is donated (aliased).
    update = abstract["phases"]["update"]
    args = bytes_on((state, batch, metrics["objective/kl"]), dev)
    assert close(update["argument_bytes"], args), (update["argument_bytes"], args)
    assert close(update["alias_bytes"], bytes_on(state, dev))
    assert update["resident_elsewhere_bytes"]["frozen_models"] == bytes_on(frozen, dev)
    new_state, _ = trainer.step(copy(state), frozen, query, mask, 0)  # the copy is donated
    assert close(update["output_bytes"], bytes_on(new_state, dev))
    assert update["peak_bytes"] >= bytes_on((new_state, frozen, batch), dev) - SLACK


# ---------------------------------------------------------- one assembly, plan == build
#: Reward options per reward kind (a new kind adds its options here); "model" twice: a
#: random trunk + head from reward.head_seed, and a reward-model directory read from disk.
REWARD_CASES = {
    "model": dict(kind="model"),
    "model_dir": dict(kind="model", path="<reward_dir>"),
    "target_tokens": dict(kind="target_tokens", target_ids=(5, 6)),
}


def _layouts():
    """(name, ppo overrides) for every estimator of the table; a critic two ways."""
    for name, spec in ESTIMATORS.items():
        ppo = dict(advantage_estimator=name, samples_per_prompt=spec.min_samples_per_prompt)
        if spec.uses_critic:
            yield f"{name}_critic", dict(ppo, shared_trunk=False)
            yield f"{name}_shared_trunk", dict(ppo, shared_trunk=True)
        else:
            yield name, ppo


ASSEMBLY_CASES = [(kind, layout, ppo) for kind in REWARD_CASES for layout, ppo in _layouts()]


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A reward-model directory: a tiny trunk (with its LM head) and a trained-looking head."""
    from pjit_ppo.models import ModelConfig, heads, init_params, save_pretrained
    config = tiny_config()
    model_cfg = ModelConfig.from_hf_dict(dict(config.model.random))
    params = jax.jit(functools.partial(init_params, model_cfg))(jax.random.PRNGKey(3))
    path = str(tmp_path_factory.mktemp("reward_model"))
    save_pretrained(path, model_cfg, params)
    head = heads.init_reward_head(model_cfg.d_model, jax.random.PRNGKey(4))
    head["reward_head"]["gain"] = jnp.full((), 2.0)
    heads.save_reward_head(path, head)
    return path


#: Kinds whose planning is tested where their inputs are made (text prompts and a
#: tokenizer): tests/test_function_reward.py plans a run with a function term.
PLANNED_ELSEWHERE = {"function", "terms"}


def test_every_reward_kind_has_an_assembly_case():
    assert set(rewards.KINDS) - PLANNED_ELSEWHERE <= {c["kind"] for c in REWARD_CASES.values()}


@pytest.mark.parametrize("kind,layout,ppo", ASSEMBLY_CASES,
                         ids=[f"{k}-{l}" for k, l, _ in ASSEMBLY_CASES])
def test_planner_assembles_what_the_build_allocates(kind, layout, ppo, reward_dir):
    """The planner's abstract run and the real build are one assembly: the same trees,
    shapes, dtypes and shardings, so the same argument bytes per device, for every
    reward kind and every estimator layout (nothing is compiled here)."""
    options = {k: (reward_dir if v == "<reward_dir>" else v)
               for k, v in REWARD_CASES[kind].items()}
    critic_init = "reward" if rewards.get(options["kind"]).critic_trunk else "policy"
    config = tiny_config(critic_init=critic_init, **ppo)
    config.reward = RewardOptions(**options)
    config.model.compute_dtype = "bfloat16"  # frozen copies are cast: both ways alike
    job = run_lib.build(config)
    abstract = planning.abstract_run(config, job.trainer.mesh)
    real = (job.state, job.frozen)
    planned = (abstract.state, abstract.frozen)
    assert jax.tree.structure(planned) == jax.tree.structure(real)
    for (path, a), r in zip(jax.tree_util.tree_flatten_with_path(planned)[0],
                            jax.tree.leaves(real)):
        assert (a.shape, a.dtype) == (r.shape, r.dtype), jax.tree_util.keystr(path)
        assert a.sharding.is_equivalent_to(r.sharding, r.ndim), jax.tree_util.keystr(path)
    dev = jax.devices()[0]
    query, mask = job.prompts(0)
    rollout_real = memory_plan.rollout_arguments(job.state, job.frozen, query, mask)
    rollout_planned = memory_plan.rollout_arguments(abstract.state, abstract.frozen,
                                                    abstract.query, abstract.query_mask)
    assert memory_analysis.device_bytes(rollout_planned) == bytes_on(rollout_real, dev)
    assert memory_analysis.device_bytes(abstract.state) == bytes_on(job.state, dev)
    assert abstract.trainer.models.policy == job.trainer.models.policy
    assert abstract.trainer.models.critic == job.trainer.models.critic
    assert abstract.trainer.flops == job.trainer.flops
    assert (job.frozen["reward"] is None) == (options["kind"] == "target_tokens")


def test_breakdown_counts_each_model(job_and_plan):
    _, job, abstract, _ = job_and_plan
    dev = jax.devices()[0]
    b = abstract["phases"]["update"]["breakdown"]
    assert b["parameters"]["policy"] == bytes_on(job.state.params["policy"], dev)
    assert b["gradients"]["critic"] == b["parameters"]["critic"]
    # Adam: two fp32 moments per parameter (+ a step count).
    assert close(b["optimizer_state"]["policy"], 2 * b["parameters"]["policy"])
    assert set(b["frozen_models"]) == {"ref", "reward"}
    assert abstract["phases"]["rollout"]["breakdown"]["kv_cache_bytes"] > 0
    # Without LoRA (tests/test_lora_planning.py plans with it): everything trains, nothing
    # is a base, and every parameter counts as trainable.
    assert abstract["resident_breakdown_bytes"]["base"] == 0
    assert abstract["resident_breakdown_bytes"]["adapters"] == 0
    assert abstract["trainable_parameters"] == lora.count(job.state.params)


def test_cli_json_keys_are_stable(tmp_path):
    args = (f"--config={runs.TINY}", "--devices=8", "--format=json", "--search=false")
    proc = runs.run("plan.py", *args, "--device_memory=1GiB")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert {"devices", "device_memory_bytes", "fits", "phases"} <= set(out)
    assert out["devices"] == 8 and out["device_memory_bytes"] == 2**30 and out["fits"] is True
    assert set(out["phases"]) == {"rollout", "update"}
    for phase in out["phases"].values():
        assert set(planning.XLA_KEYS) | {"peak_bytes", "breakdown"} <= set(phase)
        assert phase["peak_bytes"] >= phase["argument_bytes"] + phase["temp_bytes"]
    tight = runs.run("plan.py", *args, "--device_memory=64KiB")
    assert tight.returncode == 0, tight.stderr[-3000:]
    assert json.loads(tight.stdout)["fits"] is False
    bad = runs.run("plan.py", *args, "--device_memory=lots")
    assert bad.returncode == 2
    assert "--device_memory" in bad.stderr.strip().splitlines()[-1]


def test_micro_batch_search_finds_the_largest_that_fits(monkeypatch):
    config = tiny_config(batch_size=64, nminibatches=1)
    mesh = jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor"))
    peaks = {}

    def fake(config, mesh, phase, micro):  # the peak grows with the micro-batch
        peaks[micro] = 1000 + 10 * micro
        return {"micro_batch": micro, "peak_bytes": peaks[micro], "compile_seconds": 0.0}

    monkeypatch.setattr(planning, "phase_peak_at", fake)
    assert planning.micro_batch_candidates(config.ppo, "update", 8) == [64, 32, 16, 8]
    found = planning.largest_micro_batch(config, mesh, "update", 1000 + 10 * 20)
    assert found["micro_batch"] == 16
    assert len(found["tried"]) <= 3  # bisection, not every candidate
    assert planning.largest_micro_batch(config, mesh, "rollout", 10)["micro_batch"] is None


def test_rollout_micro_batches_equal_one_pass(job_and_plan):
    _, job, _, _ = job_and_plan
    whole = job.trainer
    cfg = dataclasses.replace(whole.cfg, rollout_micro_batch_size=16)
    split = PPOTrainer(cfg, whole.models, whole.mesh, num_updates=1)
    query, mask = job.prompts(0)
    a, ma = whole.rollout(job.state, job.frozen, query, mask, 0)
    b, mb = split.rollout(job.state, job.frozen, query, mask, 0)
    # The same samples (every token equal); the float results equal up to rounding, since
    # a matmul over fewer rows may round differently.
    for name, x, y in zip(a._fields, a, b):
        if x is None:
            continue
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)
    ma, mb = jax.device_get((ma, mb))
    assert ma.keys() == mb.keys()
    for key in ma:
        np.testing.assert_allclose(ma[key], mb[key], rtol=1e-5, atol=1e-5, err_msg=key)
    with pytest.raises(ValueError, match="rollout_micro_batch_size"):
        PPOTrainer(dataclasses.replace(cfg, rollout_micro_batch_size=4), whole.models,
                   whole.mesh, num_updates=1)


def test_run_logs_the_plan_and_profiles(tmp_path):
    workdir = tmp_path / "run"
    # One epoch, 2 iterations, 4 devices: test_multihost's one-process run's program (the
    # session's compilation cache).
    proc = runs.run("train_ppo.py", *runs.train_args(workdir, "--config.profile.start=2",
                                                     *runs.ONE_EPOCH, iterations=2, every=2),
                    devices=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr
    assert "memory plan rollout: peak" in log and "memory plan update: peak" in log
    traces = [f for _, _, files in os.walk(workdir / "profile") for f in files
              if f.endswith(".xplane.pb")]
    assert traces, list(os.walk(workdir / "profile"))
    lines = runs.strict_lines(workdir / "metrics.jsonl")
    assert "time/compile_s" in lines[0] and "time/compile_s" not in lines[1]
