"""Reward learning: the loss and accuracy against numpy, normalisation to mean 0 / std 1 on
held-out samples, a short training run and its output directory, and PPO loading the trained
head (gain and bias included) from it."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_text
from pjit_ppo import reward as reward_learning, sharding
from pjit_ppo.config import ConfigError, ModelOptions, PPOConfig, RewardOptions, RunConfig
from pjit_ppo.data import DataError
from pjit_ppo.models import heads
from pjit_ppo.models.reward_model import load_reward_model, reward_scores
from pjit_ppo.reward import normalized_head, preference_loss
from pjit_ppo.config import RewardLearningConfig

LOGITS = np.array([[0.5, -1.0, 2.0, 0.1], [3.0, 3.0, -2.0, 0.0], [-0.3, 0.2, 0.2, 0.9]],
                  np.float32)


def _numpy_loss(logits, choice):
    z = logits.astype(np.float64)
    logz = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    loss = logz - z[np.arange(len(z)), choice]
    return loss, (np.argmax(z, axis=1) == choice).astype(np.float64)


@pytest.mark.parametrize("choice", [[2, 0, 3], [1, 1, 0]])
def test_best_of_n_loss_and_accuracy_match_numpy(choice):
    loss, correct = preference_loss(jnp.asarray(LOGITS), jnp.asarray(choice))
    want_loss, want_correct = _numpy_loss(LOGITS, np.asarray(choice))
    np.testing.assert_allclose(np.asarray(loss), want_loss, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(correct), want_correct)


def test_pairwise_loss_is_bradley_terry():
    r = np.array([[1.5, -0.5], [0.2, 0.7], [-3.0, 4.0]], np.float32)
    loss, correct = preference_loss(jnp.asarray(r), jnp.zeros(3, jnp.int32))
    # -log sigmoid(chosen - rejected)
    np.testing.assert_allclose(np.asarray(loss), np.log1p(np.exp(-(r[:, 0] - r[:, 1]))),
                               rtol=1e-5)
    assert np.asarray(correct).tolist() == [1.0, 0.0, 0.0]


def test_normalized_head_maps_rewards_to_target():
    raw = np.random.default_rng(0).normal(3.0, 2.5, 1000)
    head = {"w": np.zeros(4, np.float32), "b": 0.0, "gain": 1.7, "bias": -0.4}
    r = head["gain"] * raw + head["bias"]
    new = normalized_head(head, float(r.mean()), float(r.std()))
    r2 = float(new["gain"]) * raw + float(new["bias"])
    assert abs(r2.mean()) < 1e-4 and abs(r2.std() - 1.0) < 1e-4
    shifted = normalized_head(head, float(r.mean()), float(r.std()), 2.0, 0.5)
    r3 = float(shifted["gain"]) * raw + float(shifted["bias"])
    assert abs(r3.mean() - 2.0) < 1e-4 and abs(r3.std() - 0.5) < 1e-4
    with pytest.raises(FloatingPointError, match="cannot normalise"):
        normalized_head(head, 1.0, 0.0)


def test_config_errors_name_field():
    base = dict(model=ModelOptions(random=tiny_text.model_random()), labels_path="l.jsonl",
                tokenizer_path="t")
    RewardLearningConfig(**base).validate()
    with pytest.raises(ConfigError, match="batch_size=10 is not divisible by "
                                          "gradient_accumulation_steps=3"):
        RewardLearningConfig(**base, batch_size=10, gradient_accumulation_steps=3).validate()
    with pytest.raises(ConfigError, match="labels_path is empty"):
        RewardLearningConfig(**{**base, "labels_path": ""}).validate()
    with pytest.raises(ConfigError, match="optimizer='sgd'"):
        RewardLearningConfig(**base, optimizer="sgd").validate()
    with pytest.raises(AttributeError):
        RewardLearningConfig(**base).learning_rate = 1.0  # __slots__: a typo fails


def write_labels(path, n, seed):
    """Best-of-4 labels where the chosen response has the most positive words."""
    r = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            sentence = tiny_text.sentences(1, seed=int(r.integers(1 << 30)))[0].split()
            responses = [" ".join(tiny_text.sentences(1, seed=int(r.integers(1 << 30)))[0]
                                  .split()[3:]) for _ in range(4)]
            score = [sum(w in tiny_text.GOOD for w in x.split()) - sum(w in tiny_text.BAD
                                                                       for w in x.split())
                     for x in responses]
            f.write(json.dumps({"query": " ".join(sentence[:3]), "responses": responses,
                                "choice": int(np.argmax(score))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("reward")
    tiny_text.save_tokenizer(str(d / "tok"))
    config = RewardLearningConfig(
        model=ModelOptions(random=tiny_text.model_random()), labels_path=write_labels(
            d / "labels.jsonl", 160, 0), tokenizer_path=str(d / "tok"), query_length=6,
        response_length=6, pad_token_id=1, truncate_token=None, batch_size=16,
        gradient_accumulation_steps=2, lr=1e-3, num_epochs=2, norm_samples=256,
        norm_batch_size=64, log_every=3, eval_every=6, tensorboard=False)
    out = reward_learning.train(config, str(d / "work"))
    return config, out, d


@pytest.mark.slow
def test_training_run_writes_metrics_and_reward_model(trained):
    config, out, d = trained
    lines = [json.loads(line) for line in open(d / "work" / "metrics.jsonl")]
    train_lines = [m for m in lines if "train/loss" in m]
    assert {"train/loss", "train/accuracy", "train/lr"} <= set(train_lines[0])
    assert [m["iteration"] for m in lines if "test/accuracy" in m] == [0, 6, 12, 18]
    assert all("test/loss" in m for m in lines if "test/accuracy" in m)
    # lr 1e-3 annealed linearly to 0 over 18 steps (144 labels / 16, 2 epochs); logged
    # every 3 steps: the lr of the step that ended the window.
    lrs = [m["train/lr"] for m in train_lines]
    np.testing.assert_allclose(lrs, [1e-3 * (1 - (s - 1) / 18) for s in range(3, 19, 3)],
                               rtol=1e-5)
    assert train_lines[-1]["train/loss"] < train_lines[0]["train/loss"]
    assert out["test/accuracy"] > out["test/accuracy_initial"]
    assert out["steps"] == 18
    model_dir = d / "work" / "reward_model"
    assert out["reward_model_dir"] == str(model_dir)
    for name in ("config.json", "model.safetensors", heads.REWARD_HEAD_FILE,
                 "reward_model.json", "tokenizer.json"):
        assert (model_dir / name).is_file(), name
    info = json.loads((model_dir / "reward_model.json").read_text())
    assert info["query_length"] == 6 and info["responses_per_label"] == 4


@pytest.mark.slow
def test_normalisation_reaches_mean_0_std_1_on_held_out_samples(trained):
    config, out, d = trained
    # Measured before training (raw) and after training on samples that were not used to
    # set gain and bias (other prompts, other random draws).
    assert out["normalization/std_before"] > 0
    assert abs(out["normalization/mean_after"]) < 0.25
    assert abs(out["normalization/std_after"] - 1.0) < 0.2
    # The saved head reproduces it: rewards of the same kind of samples, re-measured here.
    # (Normalisation is relative to the prompts sampled from: here the labels' queries.)
    from pjit_ppo.data.preferences import load_preferences
    from pjit_ppo.data.prompts import load_tokenizer, tokenize_queries
    from pjit_ppo.models import assemble
    from pjit_ppo.loading import load_lm
    from pjit_ppo.reward.normalize import NormSampler
    mesh = sharding.make_mesh()
    cfg, params = load_reward_model(out["reward_model_dir"], mesh)
    policy_cfg, policy = load_lm(config.model, "", mesh, config.seed)  # the pretrained policy
    tok = load_tokenizer(config.tokenizer_path)
    queries = tokenize_queries([r.query for r in load_preferences(config.labels_path)], tok,
                               6, 1)
    sampler = NormSampler(config, policy_cfg, assemble.make_frozen(policy, "float32"), cfg,
                          mesh, queries)
    mean, std = sampler.measure(params, 11)  # a round of its own: fresh prompts and draws
    assert abs(mean) < 0.25 and abs(std - 1.0) < 0.2


@pytest.mark.slow
def test_ppo_uses_the_trained_head_and_critic_starts_from_the_reward_model(trained):
    from pjit_ppo.ppo.run import load_reward
    config, out, d = trained
    path = out["reward_model_dir"]
    saved = heads.load_reward_head(path, 32)["reward_head"]
    assert float(saved["gain"]) != 1.0 and float(saved["bias"]) != 0.0
    run_config = RunConfig(
        model=ModelOptions(random=tiny_text.model_random()),
        reward=RewardOptions(kind="model", path=path, head_seed=123),
        ppo=PPOConfig(query_length=6, response_length=6, batch_size=16, critic_init="reward",
                      pad_token_id=1, truncate_token=None))
    mesh = sharding.make_mesh()
    model_cfg, reward_fn, frozen, critic_source = load_reward(run_config, mesh)
    for key in ("w", "b", "gain", "bias"):
        np.testing.assert_array_equal(np.asarray(frozen["reward_head"][key]), saved[key])
        np.testing.assert_array_equal(np.asarray(critic_source["reward_head"][key]), saved[key])
    # The trained trunk (not a fresh init) is what PPO scores with and the critic copies.
    _, reference = load_reward_model(path, mesh)
    q = jnp.asarray([[1, 1, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], jnp.int32)
    qm = q != 1
    resp = jnp.asarray([[15, 16, 17, 1, 1, 1], [18, 19, 20, 21, 22, 23]], jnp.int32)
    rm = resp != 1
    got = jax.jit(reward_fn)(frozen, q, qm, jnp.where(rm, resp, 0), rm)
    want = reward_scores(model_cfg, reference, q, qm, resp[:, None], rm[:, None])[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(critic_source["transformer/ln_f"]["scale"]),
        np.asarray(reference["transformer/ln_f"]["scale"]))
    # A plain LM directory has no head file: a random head from reward.head_seed.
    plain = d / "plain"
    plain.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.link(os.path.join(path, name), plain / name)
    run_config.reward.path = str(plain)
    # ... which is refused unless the user asks for it (a language model is no reward model).
    with pytest.raises(ConfigError, match="has no reward_head.safetensors.*pjit-ppo-reward"):
        load_reward(run_config, mesh)
    run_config.reward.allow_random_head = True
    _, _, frozen_plain, _ = load_reward(run_config, mesh)
    assert float(frozen_plain["reward_head"]["gain"]) == 1.0
    fresh = heads.init_reward_head(32, jax.random.PRNGKey(123))["reward_head"]
    np.testing.assert_array_equal(np.asarray(frozen_plain["reward_head"]["w"]),
                                  np.asarray(fresh["w"]))


def test_tokenizer_that_does_not_fit_the_model_fails_before_loading(tmp_path):
    tiny_text.save_tokenizer(str(tmp_path / "tok"))
    base = dict(labels_path=write_labels(tmp_path / "l.jsonl", 40, 1),
                tokenizer_path=str(tmp_path / "tok"), query_length=6, response_length=6,
                pad_token_id=1, truncate_token=None, batch_size=8)
    small = RewardLearningConfig(model=ModelOptions(random=tiny_text.model_random(
        vocab_size=16)), **base)
    with pytest.raises(DataError, match="the model's embedding has 16 rows"):
        reward_learning.train(small, str(tmp_path / "a"))
    text_pad = RewardLearningConfig(model=ModelOptions(random=tiny_text.model_random()),
                                    **{**base, "pad_token_id": 5})
    with pytest.raises(DataError, match="pad_token_id=5 is the text token"):
        reward_learning.train(text_pad, str(tmp_path / "b"))
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
