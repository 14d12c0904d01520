"""The public API (`pjit_ppo/__init__.py`, listed in WORKSPACE.md) is the contract users and
tests import: every name resolves, each stage's entry function is that stage's, and the
earlier names still work."""
import subprocess
import sys

import pjit_ppo


def test_every_public_name_resolves():
    missing = [name for name in pjit_ppo.__all__ if getattr(pjit_ppo, name, None) is None]
    assert not missing


def test_stage_functions_are_the_stages():
    from pjit_ppo import evaluation, export, planning, reward, sft
    from pjit_ppo.ppo import run
    assert pjit_ppo.train_sft is sft.train
    assert pjit_ppo.train_reward_model is reward.train
    assert pjit_ppo.train_ppo is run.train and pjit_ppo.build_ppo is run.build
    assert pjit_ppo.evaluate_ppo is evaluation.evaluate
    assert pjit_ppo.export_policy is export.export_policy
    assert pjit_ppo.plan_ppo is planning.plan


def test_earlier_names_are_kept():
    assert pjit_ppo.RunConfig is pjit_ppo.PPORunConfig
    assert pjit_ppo.train is pjit_ppo.train_ppo and pjit_ppo.build is pjit_ppo.build_ppo


def test_configs_and_errors_load_without_jax():
    code = ("import sys; from pjit_ppo import PPORunConfig, SFTConfig, RewardLearningConfig, "
            "ConfigError, DataError; print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
