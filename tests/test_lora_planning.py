"""The planner with LoRA adapters: its abstract run is the build's (adapters, frozen base =
reference, LoRA critic on a frozen trunk), it counts trainable and total parameters and
splits the resident bytes into base, adapters, other trained parameters, optimizer
state and frozen models; the scale recipes' `lora` (and `grpo`) variants."""
import jax
import pytest

from pjit_ppo import memory_analysis, planning
from pjit_ppo.config import RewardOptions
from pjit_ppo.models import lora
from pjit_ppo.ppo import run as run_lib
from test_lora_training import _ppo_config
from test_planning import bytes_on, tiny_config
from test_recipes import load

CASES = {
    "critic_on_reward_trunk": dict(critic_init="reward"),
    "full_critic": dict(critic_init="reward", critic_lora=False),
    "shared_trunk": dict(critic_init="policy", shared_trunk=True),
    "grpo": dict(advantage_estimator="grpo", samples_per_prompt=2),
}


def _lora_config(**ppo):
    config = tiny_config(**ppo)
    config.reward = RewardOptions(kind="model")
    config.model.compute_dtype = "bfloat16"
    config.model.lora.rank = 4
    return config


@pytest.mark.parametrize("case", CASES)
def test_planner_assembles_what_the_lora_build_allocates(case):
    config = _lora_config(**CASES[case])
    job = run_lib.build(config)
    abstract = planning.abstract_run(config, job.trainer.mesh)
    real, planned = (job.state, job.frozen), (abstract.state, abstract.frozen)
    assert jax.tree.structure(planned) == jax.tree.structure(real)
    for (path, a), r in zip(jax.tree_util.tree_flatten_with_path(planned)[0],
                            jax.tree.leaves(real)):
        assert (a.shape, a.dtype) == (r.shape, r.dtype), jax.tree_util.keystr(path)
        assert a.sharding.is_equivalent_to(r.sharding, r.ndim), jax.tree_util.keystr(path)
    a, r = abstract.trainer.models, job.trainer.models
    assert (a.policy, a.critic, a.critic_base) == (r.policy, r.critic, r.critic_base)
    assert a.policy.lora is not None
    assert memory_analysis.device_bytes(abstract.state) == bytes_on(job.state,
                                                                    jax.devices()[0])


def _trained_case_config():
    """tests/test_lora_training.py's gae_lora_critic_on_reward_trunk run (a LoRA critic on
    the reward model's trunk): the plan compiles that run's two programs, which the
    session's compilation cache then holds once for both modules."""
    config = _ppo_config(critic_init="reward")
    config.reward.kind = "model"
    return config


def test_plan_counts_parameters_and_splits_the_resident_bytes():
    config = _trained_case_config()
    plan = planning.plan(config, device_memory=2**30)
    run = planning.abstract_run(config, planning.sharding.make_mesh())
    adapters = lora.count(run.state.params["policy"]) + lora.count(
        {k: v for k, v in run.state.params["critic"].items() if k != "value_head"})
    heads = lora.count(run.state.params["critic"]["value_head"])
    assert plan["trainable_parameters"] == adapters + heads
    base = lora.count(run.frozen["ref"])
    assert plan["total_parameters"] == adapters + heads + base + lora.count(run.frozen["reward"])
    parts = plan["resident_breakdown_bytes"]
    assert set(parts) == {"base", "adapters", "trained", "optimizer_state", "frozen_models"}
    assert parts["base"] == memory_analysis.device_bytes(run.frozen["ref"])
    assert parts["frozen_models"] == memory_analysis.device_bytes(run.frozen["reward"])
    assert parts["trained"] == memory_analysis.device_bytes(
        run.state.params["critic"]["value_head"])
    assert parts["optimizer_state"] == memory_analysis.device_bytes(run.state.opt_state)
    assert sum(parts.values()) == pytest.approx(plan["resident_bytes"], rel=0.01)
    # The update reads the bases as arguments: nothing frozen stays resident beside it.
    assert plan["phases"]["update"]["resident_elsewhere_bytes"]["frozen_models"] == 0
    # Without LoRA: everything trains, nothing is a base. The plan of that run (the same
    # tiny_config()) is compiled once, by tests/test_planning.py's job_and_plan fixture:
    # test_breakdown_counts_each_model checks there that its base and adapters are 0 and
    # that its trainable_parameters count every parameter of the (abstract) run counted here.
    full = planning.abstract_run(tiny_config(), planning.sharding.make_mesh())
    assert lora.count(full.state.params) > 10 * plan["trainable_parameters"]
    assert "parameters:" in planning.to_text(plan) and "resident base" in planning.to_text(plan)


def test_scale_recipes_have_lora_variants():
    gptj = load("gptj_6b", "lora")
    assert gptj.model.lora.rank == 16 and gptj.ppo.critic_lora and gptj.ppo.batch_size == 512
    assert gptj.reward.kind == "model" and gptj.ppo.critic_init == "reward"
    llama = load("llama_7b", "lora,grpo")
    assert llama.model.lora.rank == 16 and llama.ppo.advantage_estimator == "grpo"
    assert (llama.ppo.prompts_per_iteration, llama.ppo.samples_per_prompt) == (64, 8)
    assert (llama.ppo.query_length, llama.ppo.response_length) == (256, 256)
    assert load("llama_7b", "grpo,lora").to_dict() == llama.to_dict()
    for config in (gptj, llama):
        config.validate()


def test_planner_plans_a_recipe_before_its_download(monkeypatch, tmp_path):
    """llama_7b names models/llama-2-7b and a reward model, neither here: the planner plans
    the shape the recipe gives in model.random and says so."""
    from pjit_ppo.cli import plan as plan_cli
    monkeypatch.chdir(tmp_path)
    config = load("llama_7b", "lora,grpo")
    notes = plan_cli.plan_shapes_without_downloads(config)
    assert config.model.policy_path == "" and config.reward.path == ""
    assert len(notes) == 2 and "model.policy_path='models/llama-2-7b' is not here" in notes[0]
    assert config.model.random["hidden_size"] == 4096
    # The user's own policy is here and the reward model is not: their mistake, left for
    # the launch checks to name (tests/test_newcomer_defects.py).
    (tmp_path / "models" / "llama-2-7b").mkdir(parents=True)
    config = load("llama_7b", "lora,grpo")
    assert plan_cli.plan_shapes_without_downloads(config) == []
    assert config.model.policy_path == "models/llama-2-7b"
    assert config.reward.path == "models/llama-2-7b_reward"


def test_planning_on_cpu_devices_keeps_bf16_weights_in_the_loop(monkeypatch):
    """The fake CPU devices come with XLA:CPU's weight-upcast hoisting turned off, merged
    with passes the user turned off already."""
    from pjit_ppo.cli import plan as plan_cli
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                    "--xla_disable_hlo_passes=foo --xla_dump_to=/tmp/x")
    plan_cli.fake_cpu_devices(2)
    flags = __import__("os").environ["XLA_FLAGS"].split()
    assert "--xla_force_host_platform_device_count=2" in flags and "--xla_dump_to=/tmp/x" in flags
    assert ("--xla_disable_hlo_passes=foo,while-loop-invariant-code-motion,"
            "while-loop-expensive-invariant-code-motion") in flags
    assert len(flags) == 3
