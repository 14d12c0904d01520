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


#: Recipes for the user's own model: (the error without it, the options a user gives).
NEEDS_USER_INPUT = {
    "hf_model": ("model.policy_path is empty", {"model.policy_path": "my_model"}),
    "hf_reward": ("model.policy_path is empty", {"model.policy_path": "my_model",
                                                 "labels_path": "labels.jsonl"}),
}


def test_every_recipe_file_loads_and_validates():
    """All of configs/*.py (the demos and other helpers' recipes too), at their defaults."""
    names = [os.path.basename(p)[:-3] for p in sorted(glob.glob(os.path.join(CONFIGS, "*.py")))]
    assert set(RECIPES) <= set(names)
    for name in names:
        if name == "base":
            continue
        config = load(name)  # a RunConfig, or the config of another entry point (SFT, ...)
        assert callable(getattr(config, "validate", None)), name
        if name in NEEDS_USER_INPUT:  # their one required option, named when missing
            with pytest.raises(ConfigError, match=NEEDS_USER_INPUT[name][0]):
                config.validate()
            for field, value in NEEDS_USER_INPUT[name][1].items():
                section, _, key = field.rpartition(".")
                setattr(getattr(config, section) if section else config, key, value)
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


def test_stage_preflights_check_paths_records_and_context(tmp_path):
    """SFT and reward learning share the pre-flight's conventions: ConfigError for the
    config, its paths and the work directory, DataError naming file and line, before any
    model is loaded."""
    from pjit_ppo.config import ModelOptions, RewardLearningConfig, SFTConfig
    from pjit_ppo.errors import DataError
    random = dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                  n_positions=32)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a b c"}\n{"text": "d e"}\n')
    labels = tmp_path / "labels.jsonl"
    labels.write_text('{"query": "q", "chosen": "a", "rejected": "b"}\n')
    sft = SFTConfig(model=ModelOptions(random=random), data_path=str(corpus),
                    tokenizer_path=str(tmp_path))
    preflight.check_sft(sft, str(tmp_path / "sft"))
    rl = RewardLearningConfig(model=ModelOptions(random=random), labels_path=str(labels),
                              tokenizer_path=str(tmp_path), query_length=8, response_length=8,
                              truncate_token=None)
    preflight.check_reward_learning(rl, str(tmp_path / "rl"))

    with pytest.raises(ConfigError, match="returned PPORunConfig; train_sft needs a SFTConfig"):
        preflight.check_sft(RunConfig(), str(tmp_path / "sft"))
    (tmp_path / "empty").mkdir()
    sft.model.policy_path = str(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"model\.policy_path=.*empty' has no config.json"):
        preflight.check_sft(sft, str(tmp_path / "sft"))
    sft.model.policy_path = ""
    with pytest.raises(ConfigError, match="--workdir=.*is a file"):
        preflight.check_sft(sft, str(corpus))
    corpus.write_text('{"text": "a b c"}\n{"txt": "d e"}\n')
    with pytest.raises(DataError, match="corpus.jsonl:2: no field 'text'"):
        preflight.check_sft(sft, str(tmp_path / "sft"))
    rl.response_length = 30
    with pytest.raises(ConfigError, match="query_length \\+ response_length of 38 tokens exceed "
                                          "the context of 32 positions of model.random"):
        preflight.check_reward_learning(rl, str(tmp_path / "rl"))
    assert not (tmp_path / "sft").exists() and not (tmp_path / "rl").exists()
