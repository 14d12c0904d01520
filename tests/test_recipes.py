"""Every recipe in configs/ loads the way the entry points load it (ml_collections, by
path, with `:ARG` variants), validates, and passes the pre-flight checks on 8 devices in
its no-download `random` variant; without the downloads, the pre-flight names the
missing path. Nothing is trained or compiled here."""
import glob
import os

import pytest
from ml_collections.config_flags import config_flags

import runs
from pjit_ppo import preflight
from pjit_ppo.config import ConfigError, RunConfig

CONFIGS = os.path.join(runs.ROOT, "configs")
RECIPES = ("gpt2_sentiment", "gpt2_descriptiveness", "pythia_1b", "llama_7b")
#: Published parameter counts (policy LM, embeddings included), in billions.
PARAMS_B = {"gpt2_sentiment": 0.124, "gpt2_descriptiveness": 0.124, "pythia_1b": 1.01,
            "llama_7b": 6.74}


def load(name: str, arg: str = "") -> RunConfig:
    """The config `--config=configs/NAME.py[:ARG]` gives an entry point."""
    path = os.path.join(CONFIGS, f"{name}.py")
    return config_flags.ConfigFileFlagParser("config").parse(f"{path}:{arg}" if arg else path)


def test_every_recipe_file_loads_and_validates():
    """All of configs/*.py (the demos and other helpers' recipes too), at their defaults."""
    names = [os.path.basename(p)[:-3] for p in sorted(glob.glob(os.path.join(CONFIGS, "*.py")))]
    assert set(RECIPES) <= set(names)
    for name in names:
        if name == "base":
            continue
        config = load(name)  # a RunConfig, or the config of another entry point (SFT, ...)
        assert callable(getattr(config, "validate", None)), name
        config.validate()
        if name in RECIPES:
            assert isinstance(config, RunConfig), name


@pytest.mark.parametrize("name", RECIPES)
def test_random_variant_passes_preflight_on_8_devices(name, tmp_path):
    config = load(name, "random")
    assert not config.model.policy_path and not config.data.prompts_path
    models = preflight.check_train(config, str(tmp_path / "run"))
    sizes = preflight.check_devices(config, models, device_count=8)
    assert sizes == {"data": 1, "fsdp": 8, "tensor": 1}
    assert models.policy.num_params / 1e9 == pytest.approx(PARAMS_B[name], rel=0.01)
    assert models.reward is not None and config.ppo.critic_init == "reward"
    assert not (tmp_path / "run").exists(), "the checks must not create the work directory"


@pytest.mark.parametrize("name", RECIPES)
def test_lm_human_preferences_defaults(name):
    ppo = load(name).ppo
    assert (ppo.query_length, ppo.response_length, ppo.batch_size) == (64, 24, 512)
    assert (ppo.temperature, ppo.lr, ppo.noptepochs, ppo.nminibatches) == (0.7, 1e-5, 4, 1)
    assert (ppo.init_kl_coef, ppo.kl_target, ppo.kl_horizon) == (0.15, 6.0, 10000)
    assert (ppo.truncate_after, ppo.penalty_reward_value, ppo.total_episodes) == (
        16, -1.0, 1_000_000)


def test_sentiment_and_descriptiveness_differ_only_in_the_reward():
    a, b = load("gpt2_sentiment").to_dict(), load("gpt2_descriptiveness").to_dict()
    diff = {k for k in a if a[k] != b[k]}
    assert diff == {"reward"}
    assert a["reward"]["path"] != b["reward"]["path"]
    assert a["ppo"]["truncate_token"] == 13 and a["data"]["start_text"] == "."


def test_variants():
    assert load("pythia_1b", "random,tp2").mesh.tensor == 2
    assert load("llama_7b", "dp").mesh.data == -1
    assert load("gpt2_sentiment", "small").ppo.batch_size == 64
    config = load("pythia_1b", "random,tp2")
    models = preflight.check_train(config, "/tmp/unused-run-dir")
    assert preflight.check_devices(config, models, 8) == {"data": 1, "fsdp": 4, "tensor": 2}
    with pytest.raises(ValueError, match="unknown recipe variant 'huge'"):
        load("llama_7b", "huge")


def test_gpt2_vocabulary_rules_out_tensor_parallelism():
    """GPT-2's 50257-row embedding is sharded over `tensor`; the pre-flight says so."""
    config = load("gpt2_sentiment", "random,tp2")
    models = preflight.check_train(config, "/tmp/unused-run-dir")
    with pytest.raises(ConfigError, match="'vocab', size 50257"):
        preflight.check_devices(config, models, 8)


@pytest.mark.parametrize("name", RECIPES)
def test_real_run_without_downloads_names_the_missing_path(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipes' relative paths resolve against the cwd
    with pytest.raises(ConfigError, match=r"(data\.prompts_path|model\.policy_path)=.*no such "):
        preflight.check_train(load(name), str(tmp_path / "run"))
