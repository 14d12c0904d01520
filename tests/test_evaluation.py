"""Evaluating and exporting checkpoints: launch/evaluate.py and launch/export_hf.py."""
import importlib.util
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers

import runs
from pjit_ppo import checkpoint, evaluation, sharding
from pjit_ppo.models import ModelConfig, init_params, lm_logits, param_shapes

pytestmark = pytest.mark.slow


def _recipe():
    spec = importlib.util.spec_from_file_location("recipe", runs.TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short run that learns (checkpoints 3, 6, 9)."""
    workdir = tmp_path_factory.mktemp("trained")
    proc = runs.run("train_ppo.py", *runs.train_args(workdir, iterations=9))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_evaluate_writes_the_report_and_samples(trained):
    proc = runs.run("evaluate.py", f"--config={runs.TINY}", f"--workdir={trained}",
                    "--config.evaluation.num_prompts=128")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((trained / "eval" / "9" / "eval.json").read_text())
    assert report["checkpoint_step"] == 9 and report["num_prompts"] == 128
    for key in ("reward_mean", "reward_std", "kl_mean", "win_rate_vs_reference"):
        assert np.isfinite(report[key]), key
    # After 9 iterations of learning to emit target tokens the policy beats the reference.
    assert report["reward_mean"] > report["reference_reward_mean"]
    assert report["win_rate_vs_reference"] > 0.6 and report["kl_mean"] > 0.1
    samples = runs.strict_lines(trained / "eval" / "9" / "samples.jsonl")
    assert len(samples) == 128
    row = samples[0]
    assert set(row) >= {"prompt", "policy_response", "reference_response", "policy_reward",
                        "reference_reward"}
    assert len(row["policy_response"]) == 8 and all(isinstance(t, int) for t in row["prompt"])
    np.testing.assert_allclose(np.mean([r["policy_reward"] for r in samples]),
                               report["reward_mean"], rtol=1e-5)

    proc = runs.run("evaluate.py", f"--config={runs.TINY}", f"--workdir={trained}", "--step=3",
                    "--config.evaluation.num_prompts=64", "--config.evaluation.greedy=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((trained / "eval" / "3" / "eval.json").read_text())["greedy"] is True

    proc = runs.run("evaluate.py", f"--config={runs.TINY}", f"--workdir={trained}", "--step=4")
    assert proc.returncode == 1 and "no checkpoint 4" in proc.stderr


def test_reference_against_itself(tmp_path):
    """lr = 0: the policy is the reference, so the KL is 0 and the win rate near 0.5."""
    workdir = tmp_path / "run"
    proc = runs.run("train_ppo.py", *runs.train_args(workdir, "--config.ppo.lr=0",
                                                     iterations=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = _recipe()
    config.evaluation.num_prompts = 512
    report = evaluation.evaluate(config, str(workdir))  # restored onto this process's 8 devices
    assert report["checkpoint_step"] == 3
    assert abs(report["kl_mean"]) < 1e-5
    assert 0.45 < report["win_rate_vs_reference"] < 0.55
    assert abs(report["reward_mean"] - report["reference_reward_mean"]) < 0.05


def test_evaluation_refuses_a_config_for_other_models(trained, tmp_path):
    config = _recipe()
    config.reward.target_ids = (1, 2)
    with pytest.raises(Exception, match=r"reward.target_ids: checkpoint \[5, 6, 7\], now"):
        evaluation.evaluate(config, str(trained))


def test_export_round_trip_matches_transformers(trained, tmp_path):
    out = tmp_path / "hf"
    proc = runs.run("export_hf.py", f"--workdir={trained}", f"--output={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))

    # Our logits from the checkpoint's policy, restored in this process.
    model_cfg = ModelConfig.from_hf_dict(dict(_recipe().model.random))
    mesh = sharding.make_mesh(fsdp=-1)
    shapes = param_shapes(model_cfg)
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, sharding.param_shardings(shapes, mesh))
    step, params = checkpoint.RunCheckpointer(str(trained), read_only=True).restore_policy(
        None, target)
    assert step == 9
    ids = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (3, 12))
    mask = np.ones_like(ids, bool)
    ours = np.asarray(lm_logits(model_cfg, params, ids, mask))

    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    # The export is the trained policy, not the initial one.
    initial = init_params(model_cfg, jax.random.PRNGKey(_recipe().ppo.seed))
    fc_in = "transformer/layers/mlp/fc_in"
    assert not np.allclose(params[fc_in]["w"], initial[fc_in]["w"], atol=1e-4)
