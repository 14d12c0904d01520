"""Training with LoRA adapters (model.lora.rank > 0) in every stage that trains a policy:
PPO (with a critic and critic-free) updates only adapter leaves (and the value head),
keeps optimizer state for them only, and scores the reference with the base weights
the adapters sit on (one set of base weights); SFT and DPO train adapters only,
checkpoint them, and save the merged model."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_text
from pjit_ppo import dpo, sft, sharding
from pjit_ppo.config import CheckpointOptions, DPOConfig, ModelOptions, SFTConfig
from pjit_ppo.loading import load_lm
from pjit_ppo.models import assemble, forward, load_pretrained, lora, scoring
from pjit_ppo.ppo import lora_views
from pjit_ppo.ppo import run as ppo_run
from test_reward_learning import write_labels

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs"))
import tiny_demo  # noqa: E402  (configs/tiny_demo.py)


def _ppo_config(**ppo):
    config = tiny_demo.get_config()
    config.measure_peak = False
    config.model.lora.rank = 4
    fields = dict(batch_size=32, nminibatches=2, noptepochs=1, gradient_accumulation_steps=2)
    fields.update(ppo)
    for k, v in fields.items():
        setattr(config.ppo, k, v)
    return config


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _adapter_leaves(tree):
    return [sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# (id, ppo fields, reward kind): a critic on the policy's base, on the reward model's
# trunk, a full critic, and a critic-free estimator.
PPO_CASES = (
    ("gae_lora_critic_on_policy_base", {}, None),
    ("gae_lora_critic_on_reward_trunk", {"critic_init": "reward"}, "model"),
    ("gae_full_critic", {"critic_lora": False}, None),
    ("grpo", {"advantage_estimator": "grpo", "samples_per_prompt": 4}, None),
)


@pytest.fixture(scope="module")
def trained():
    """case -> the case's run, built once per module (the GRPO case's run also serves the
    reference-pass test) and two PPO steps taken: a dict of the config, the job, the params
    and frozen models before the steps (host copies), the state after them and each step's
    metrics."""
    runs = {}

    def get(case):
        name, fields, reward = case
        if name not in runs:
            config = _ppo_config(**fields)
            if reward == "model":
                config.reward.kind = "model"
            job = ppo_run.build(config)
            state = job.state
            before, frozen_before = _host(state.params), _host(job.frozen)
            metrics = []
            for it in range(2):  # adapters away from zero: the policy differs from the base
                state, m = job.trainer.step(state, job.frozen, *job.prompts(it), it)
                metrics.append(m)
            runs[name] = dict(config=config, job=job, before=before,
                              frozen_before=frozen_before, state=state, metrics=metrics)
        return runs[name]

    return get


@pytest.mark.parametrize("case", PPO_CASES, ids=[c[0] for c in PPO_CASES])
def test_ppo_update_changes_only_adapter_leaves(trained, case):
    _, fields, reward = case
    run = trained(case)
    job, state = run["job"], run["state"]  # after two steps (the tree is the initial one's)
    models = job.trainer.models
    policy_leaves = _adapter_leaves(state.params["policy"])
    assert policy_leaves and all(p.rsplit("/", 1)[-1] in lora.ADAPTER_NAMES
                                 for p in policy_leaves)
    assert _adapter_leaves(run["before"]["policy"]) == policy_leaves
    critic = state.params.get("critic")
    if fields.get("critic_lora") is False:  # the whole critic trains, from the base, fp32
        assert models.critic_base is None and models.critic.lora is None
        assert critic["transformer/embed"]["embeddings"].dtype == jnp.float32
    elif critic is not None:
        assert set(critic) - set(lora.adapter_shapes(models.critic)) == {"value_head"}
        assert models.critic_base == (("reward",) if reward == "model" else ("ref",))
    # The reference is the base the adapters sit on: the same arrays, no copy.
    view = lora_views.view(models, state.params, job.frozen)
    assert view["policy"]["transformer/embed"]["embeddings"] is \
        job.frozen["ref"]["transformer/embed"]["embeddings"]
    # Optimizer state only for what trains (two Adam moments each, plus counters).
    trained = lora.count(state.params)
    assert 2 * trained <= lora.count(state.opt_state) <= 2 * trained + 8
    for metrics in run["metrics"]:
        assert all(np.isfinite(v) for k, v in metrics.items() if k in (
            "ppo/loss/total", "ppo/grad_norm", "objective/kl"))
    before, frozen_before = run["before"], run["frozen_before"]
    after, frozen_after = _host(state.params), _host(job.frozen)
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(frozen_after)):
        np.testing.assert_array_equal(a, b)  # base, reference and reward untouched
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), before, after)
    for module, leaves in moved["policy"].items():
        assert leaves["lora_b"] > 0, module  # every adapter of the policy trained
    assert jax.tree.structure(before) == jax.tree.structure(after)


def test_reference_pass_is_the_base_model_without_adapters(trained):
    run = trained(next(c for c in PPO_CASES if c[0] == "grpo"))  # two steps taken
    config, job, state = run["config"], run["job"], run["state"]
    batch, _ = job.trainer.rollout(state, job.frozen, *job.prompts(2), 2)
    # The base model, loaded on its own (no adapters anywhere), in the compute dtype.
    mesh = job.trainer.mesh
    base_cfg, initial = load_lm(config.model, "", mesh, config.ppo.seed)
    base = assemble.make_frozen(initial, base_cfg.compute_dtype)
    assert base_cfg.lora is None
    models = job.trainer.models

    @jax.jit
    def passes(base, ref):
        def logprobs(cfg, params):
            return scoring.response_logprobs(cfg, params, batch.query, batch.query_mask,
                                             batch.response, config.ppo.temperature)
        return logprobs(base_cfg, base), logprobs(models.reference, ref)
    want, ref_pass = passes(base, job.frozen["ref"])
    # The run's reference pass (the policy's config without adapters, on the frozen base)
    # is the base model's, bit for bit; the rollout program's equals it to float rounding.
    np.testing.assert_array_equal(np.asarray(ref_pass), np.asarray(want))
    np.testing.assert_allclose(np.asarray(batch.ref_logprobs), np.asarray(want), rtol=1e-6)
    assert float(jnp.abs(batch.logprobs - batch.ref_logprobs).max()) > 1e-4


# ---------------------------------------------------------------------------- SFT, DPO
@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft_lora")
    tiny_text.save_tokenizer(str(d / "tok"))
    (d / "corpus.txt").write_text("\n".join(tiny_text.sentences(200)) + "\n")
    model = ModelOptions(random=tiny_text.model_random())
    model.lora.rank, model.lora.alpha = 8, 16.0
    config = SFTConfig(model=model, data_path=str(d / "corpus.txt"),
                       tokenizer_path=str(d / "tok"), seq_length=12, batch_size=16,
                       gradient_accumulation_steps=2, max_steps=16, lr=1e-2, eval_every=8,
                       log_every=8, eval_fraction=0.1, tensorboard=False,
                       checkpoint=CheckpointOptions(every=16, async_save=False))  # one save
    return config, sft.train(config, str(d / "work")), d


def test_sft_trains_adapters_and_saves_the_merged_model(sft_run):
    config, out, d = sft_run
    assert out["test/loss"] < out["test/loss_initial"] - 0.2  # 4.19 -> 3.82
    from pjit_ppo import checkpoint
    ckpt = checkpoint.RunCheckpointer(str(d / "work"), read_only=True)
    step, info = ckpt.resolve(None)
    assert step == 16 and len(info["lora_base"]) == 16
    # model/ is an ordinary model: the adapters merged into the (float32) base. Its
    # forward equals the adapted forward of the checkpoint's adapters on the base.
    mesh = sharding.make_mesh()
    merged_cfg, merged = load_pretrained(out["model_dir"], mesh=mesh)
    base_cfg, base = load_lm(config.model, "", mesh, config.seed)
    spec = lora.spec_from_options(config.model.lora)
    adapted_cfg = lora.with_adapters(base_cfg, spec)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                         sharding=sharding.replicated(mesh)),
                          lora.adapter_shapes(adapted_cfg))
    _, adapters = ckpt.restore_item(step, "params", target)
    ids = jnp.array([[3, 5, 7, 9, 11, 4]])
    mask = jnp.ones_like(ids, bool)
    a = forward(adapted_cfg, lora.attach(base, adapters), ids, mask)[1]
    b = forward(merged_cfg, merged, ids, mask)[1]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
    c = forward(base_cfg, base, ids, mask)[1]
    assert float(jnp.abs(a - c).max()) > 1e-2


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo_lora")
    tiny_text.save_tokenizer(str(d / "tok"))
    labels = write_labels(d / "labels.jsonl", 48, 0)
    model = ModelOptions(random=tiny_text.model_random())
    model.lora.rank, model.lora.dropout = 8, 0.05
    config = DPOConfig(model=model, labels_path=labels, tokenizer_path=str(d / "tok"),
                       query_length=6, response_length=6, pad_token_id=1, truncate_token=None,
                       batch_size=16, gradient_accumulation_steps=2, lr=1e-2, max_steps=12,
                       log_every=6, eval_every=6, tensorboard=False,
                       checkpoint=CheckpointOptions(every=12))  # one save, at the end
    return config, dpo.train(config, str(d / "work")), d


def test_dpo_reference_is_the_base_and_the_adapters_learn(dpo_run):
    from pjit_ppo.data.prompts import load_tokenizer
    from pjit_ppo.dpo import pairs
    config, out, d = dpo_run
    lines = [json.loads(line) for line in open(d / "work" / "metrics.jsonl")]
    tests = [m for m in lines if "test/loss" in m]
    np.testing.assert_allclose(tests[0]["test/loss"], np.log(2), rtol=1e-6)  # policy = ref
    assert tests[-1]["test/loss"] < tests[0]["test/loss"]
    saved = np.load(d / "work" / dpo.REFERENCE_FILE)
    _, test_records = pairs.split_labels(config)
    arrays = pairs.tokenized_pairs(test_records, load_tokenizer(config.tokenizer_path), config)
    base_cfg, initial = load_lm(config.model, "", sharding.make_mesh(), config.seed)
    want = jax.jit(lambda p, b: dpo.pair_logps(base_cfg, p, b))(initial, arrays)
    np.testing.assert_allclose(saved["test/ref_chosen"], np.asarray(want[0]), rtol=1e-5)
