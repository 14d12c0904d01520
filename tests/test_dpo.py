"""DPO: the loss and its TRL-named metrics against numpy for each loss type, best-of-N labels
as pairs, the summed response log-probs against a full-logits computation, the config
checks, and short training runs (the reference = the initial policy, its log-probs saved
with the run, precomputed and per-batch reference giving the same run, a model directory
that loads)."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_text
from pjit_ppo import dpo, preflight, sharding
from pjit_ppo.config import ConfigError, DPOConfig, ModelOptions
from pjit_ppo.data import DataError, preferences
from test_reward_learning import write_labels

R = np.random.default_rng(0)
PC, PR, RC, RR = (R.normal(-20, 4, 16).astype(np.float32) for _ in range(4))


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _numpy_dpo(pc, pr, rc, rr, beta, loss_type, ls):
    """The DPO / cDPO / IPO loss and metrics of each pair, in float64."""
    pc, pr, rc, rr = (np.asarray(x, np.float64) for x in (pc, pr, rc, rr))
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        loss = -(1 - ls) * _log_sigmoid(beta * h) - ls * _log_sigmoid(-beta * h)
    else:
        loss = (h - 1 / (2 * beta)) ** 2
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    return loss, {"rewards/chosen": chosen, "rewards/rejected": rejected,
                  "rewards/accuracies": (chosen > rejected).astype(np.float64),
                  "rewards/margins": chosen - rejected, "logps/chosen": pc,
                  "logps/rejected": pr}


@pytest.mark.parametrize("loss_type,beta,ls", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2),
                                               ("ipo", 0.1, 0.0), ("ipo", 2.0, 0.0)])
def test_dpo_loss_matches_numpy(loss_type, beta, ls):
    loss, metrics = dpo.dpo_loss(PC, PR, RC, RR, beta=beta, loss_type=loss_type,
                                 label_smoothing=ls)
    want_loss, want = _numpy_dpo(PC, PR, RC, RR, beta, loss_type, ls)
    assert loss.shape == () and loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), want_loss.mean(), rtol=2e-5)
    assert list(metrics) == list(dpo.METRICS)  # TRL's names, in TRL's order
    for name, value in want.items():
        np.testing.assert_allclose(float(metrics[name]), value.mean(), rtol=2e-5, atol=1e-6,
                                   err_msg=name)
    assert 0 < float(metrics["rewards/accuracies"]) < 1  # the data have both kinds
    # Per pair, and a weighted mean that drops the zero-weight pairs.
    per_pair, per_metrics = dpo.pair_losses(PC, PR, RC, RR, beta=beta, loss_type=loss_type,
                                            label_smoothing=ls)
    np.testing.assert_allclose(np.asarray(per_pair), want_loss, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(per_metrics["rewards/margins"]),
                               want["rewards/margins"], rtol=1e-5, atol=1e-6)
    w = (np.arange(16) % 3 != 0).astype(np.float32)
    weighted, wm = dpo.dpo_loss(PC, PR, RC, RR, beta=beta, loss_type=loss_type,
                                label_smoothing=ls, weight=w)
    np.testing.assert_allclose(float(weighted), want_loss[w > 0].mean(), rtol=2e-5)
    np.testing.assert_allclose(float(wm["logps/chosen"]), PC[w > 0].mean(), rtol=1e-6)


def test_dpo_loss_limits_and_gradient():
    zero = np.zeros(4, np.float32)
    # Policy = reference: log 2 for DPO, 1 / (4 beta^2) for IPO, rewards 0, accuracy 0.
    loss, m = dpo.dpo_loss(zero, zero, zero, zero, beta=0.1)
    np.testing.assert_allclose(float(loss), math.log(2), rtol=1e-6)
    assert float(m["rewards/margins"]) == 0 and float(m["rewards/accuracies"]) == 0
    loss, _ = dpo.dpo_loss(zero, zero, zero, zero, beta=0.5, loss_type="ipo")
    np.testing.assert_allclose(float(loss), 1.0, rtol=1e-6)
    # The gradient raises the chosen and lowers the rejected log-prob: for DPO,
    # d loss / d pc = -beta sigmoid(-beta h) (1 - ls) + beta ls sigmoid(beta h).
    grad = jax.grad(lambda pc: dpo.dpo_loss(pc, PR, RC, RR, beta=0.3,
                                            label_smoothing=0.1)[0])(jnp.asarray(PC))
    h = (PC - RC) - (PR - RR)
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    want = (-0.3 * sig(-0.3 * h) * 0.9 + 0.3 * 0.1 * sig(0.3 * h)) / 16
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="loss_type='hinge'"):
        dpo.dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing applies to loss_type='sigmoid'"):
        dpo.dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="ipo", label_smoothing=0.1)


def test_best_of_n_labels_become_n_minus_1_pairs_each():
    responses = np.arange(2 * 4 * 3, dtype=np.int32).reshape(2, 4, 3)
    mask = np.ones((2, 4, 3), bool)
    mask[1, 2, 1:] = False
    prefs = preferences.Preferences(np.array([[1, 5], [7, 8]], np.int32), responses, mask,
                                    np.array([2, 0], np.int32))
    pairs = dpo.preference_pairs(prefs, pad_id=1)
    assert len(pairs["weight"]) == 6 and (pairs["weight"] == 1).all()
    np.testing.assert_array_equal(pairs["query"], [[1, 5]] * 3 + [[7, 8]] * 3)
    np.testing.assert_array_equal(pairs["query_mask"], [[False, True]] * 3 + [[True, True]] * 3)
    # Label 0 chose response 2: rejected 0, 1, 3. Label 1 chose 0: rejected 1, 2, 3.
    np.testing.assert_array_equal(pairs["chosen"],
                                  responses[[0, 0, 0, 1, 1, 1], [2, 2, 2, 0, 0, 0]])
    np.testing.assert_array_equal(pairs["rejected"],
                                  responses[[0, 0, 0, 1, 1, 1], [0, 1, 3, 1, 2, 3]])
    np.testing.assert_array_equal(pairs["rejected_mask"][4], [True, False, False])
    # A pairwise label (responses [chosen, rejected], choice 0) is one pair.
    pair = dpo.preference_pairs(preferences.Preferences(
        prefs.query, responses[:, :2], mask[:, :2], np.zeros(2, np.int32)), pad_id=1)
    np.testing.assert_array_equal(pair["chosen"], responses[:, 0])
    np.testing.assert_array_equal(pair["rejected"], responses[:, 1])


def test_pair_logps_are_summed_token_logprobs_of_the_full_logits():
    """The stage's model pass (the fused LM head + token log-prob on the response
    positions) against log_softmax of the whole model's logits, with left-padded queries
    and right-padded responses."""
    from pjit_ppo.models import ModelConfig, init_params, lm_logits
    cfg = ModelConfig.from_hf_dict(tiny_text.model_random())
    # One compiled init (drawn op by op it cost about three times the CPU).
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(3))
    q = np.array([[1, 1, 5, 6], [7, 8, 9, 10]], np.int32)
    c = np.array([[11, 12, 13], [14, 1, 1]], np.int32)
    r = np.array([[15, 16, 1], [17, 18, 19]], np.int32)
    batch = {"query": q, "query_mask": q != 1, "chosen": c, "chosen_mask": c != 1,
             "rejected": r, "rejected_mask": r != 1}
    chosen, rejected = jax.jit(lambda p, b: dpo.pair_logps(cfg, p, b))(params, batch)
    logits = jax.jit(lambda p, ids, mask: lm_logits(cfg, p, ids, mask))

    def reference(resp):
        ids = np.concatenate([q, resp], 1)
        logp = np.asarray(jax.nn.log_softmax(logits(params, ids, ids != 1), axis=-1))
        out = []
        for b in range(2):
            out.append(sum(float(logp[b, 4 + t - 1, resp[b, t]]) for t in range(3)
                           if resp[b, t] != 1))
        return np.array(out)
    np.testing.assert_allclose(np.asarray(chosen), reference(c), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rejected), reference(r), rtol=1e-5)


def _config(tmp_path, **overrides):
    fields = dict(model=ModelOptions(random=tiny_text.model_random()),
                  labels_path=str(tmp_path / "labels.jsonl"), tokenizer_path=str(tmp_path),
                  query_length=6, response_length=6, pad_token_id=1, truncate_token=None)
    fields.update(overrides)
    return DPOConfig(**fields)


@pytest.mark.parametrize("overrides,message", [
    ({"beta": 0.0}, "beta=0.0 must be > 0"),
    ({"beta": float("nan")}, "beta=nan"),
    ({"loss_type": "hinge"}, "loss_type='hinge'; choose one of 'sigmoid', 'ipo'"),
    ({"label_smoothing": 0.5}, r"label_smoothing=0.5 must be a number in \[0, 0.5\)"),
    ({"label_smoothing": 0.1, "loss_type": "ipo"},
     "label_smoothing=0.1 applies to loss_type='sigmoid' only"),
    ({"lr": -1e-6}, r"lr=-1e-06 must be a number in \[0, 1\]"),
    ({"eps": 0.0}, r"eps=0.0 must be a number in \(0, 1\]"),
    ({"b2": 1.0}, r"b2=1.0 must be a number in \[0, 1\)"),
    ({"max_grad_norm": 0.0}, "max_grad_norm=0.0 must be > 0"),
    ({"batch_size": 10, "gradient_accumulation_steps": 3},
     "batch_size=10 is not divisible by gradient_accumulation_steps=3"),
    ({"max_steps": -1}, "max_steps=-1 must be an integer >= 0"),
    ({"test_fraction": 0.0}, "test_fraction=0 and no test_labels_path"),
    ({"labels_path": ""}, "labels_path is empty"),
    ({"query_length": 0}, "query_length=0 must be an integer >= 1"),
    ({"precompute_ref": 1}, "precompute_ref=1 has type int; it must be bool"),
])
def test_config_errors_name_field_value_and_range(tmp_path, overrides, message):
    _config(tmp_path).validate()
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **overrides).validate()


def test_preflight_checks_config_paths_records_and_context(tmp_path):
    (tmp_path / "labels.jsonl").write_text('{"query": "q", "chosen": "a", "rejected": "b"}\n')
    config = _config(tmp_path)
    preflight.check_dpo(config, str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="returned SFTConfig; train_dpo needs a DPOConfig"):
        from pjit_ppo.config import SFTConfig
        preflight.check_dpo(SFTConfig(), str(tmp_path / "run"))
    config.response_length = 60
    with pytest.raises(ConfigError, match=r"query_length \+ response_length of 66 tokens "
                                          r"exceed the context of 64 positions"):
        preflight.check_dpo(config, str(tmp_path / "run"))
    config.response_length = 6
    (tmp_path / "labels.jsonl").write_text('{"query": "q", "chosen": "a", "rejected": "b"}\n'
                                           '{"query": "q", "chosen": "a"}\n')
    with pytest.raises(DataError, match=r"labels.jsonl:2: missing field 'rejected'"):
        preflight.check_dpo(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- training
STEPS = 24


@pytest.fixture(scope="module")
def runs_both_ways(tmp_path_factory):
    """The same DPO run with precomputed and with per-batch reference log-probs."""
    d = tmp_path_factory.mktemp("dpo")
    tiny_text.save_tokenizer(str(d / "tok"))
    labels = write_labels(d / "labels.jsonl", 80, 0)  # 72 training labels -> 216 pairs
    out = {}
    for precompute in (True, False):
        config = DPOConfig(
            model=ModelOptions(random=tiny_text.model_random()), labels_path=labels,
            tokenizer_path=str(d / "tok"), query_length=6, response_length=6, pad_token_id=1,
            truncate_token=None, batch_size=16, gradient_accumulation_steps=2, lr=1e-3,
            max_steps=STEPS, log_every=6, eval_every=12, tensorboard=False,
            precompute_ref=precompute)
        workdir = d / f"work_{precompute}"
        out[precompute] = (config, dpo.train(config, str(workdir)), workdir)
    return out


def _lines(workdir):
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


@pytest.mark.slow
def test_dpo_learns_the_labels_from_the_initial_policy(runs_both_ways):
    config, out, workdir = runs_both_ways[True]
    assert out["steps"] == STEPS and out["pairs"] == 216
    lines = _lines(workdir)
    tests = [m for m in lines if "test/loss" in m]
    assert [m["iteration"] for m in tests] == [0, 12, 24]
    # Step 0: the policy is the reference: loss log 2, every reward 0.
    np.testing.assert_allclose(tests[0]["test/loss"], math.log(2), rtol=1e-6)
    assert tests[0]["test/rewards/margins"] == 0 and tests[0]["test/rewards/accuracies"] == 0
    assert tests[-1]["test/loss"] < tests[1]["test/loss"] < tests[0]["test/loss"]
    assert out["test/rewards/accuracies"] > 0.65 and out["test/rewards/margins"] > 0
    train = [m for m in lines if "train/loss" in m]
    assert [m["iteration"] for m in train] == [6, 12, 18, 24]
    assert {f"train/{k}" for k in dpo.METRICS} | {"train/grad_norm", "train/lr"} <= set(train[0])
    np.testing.assert_allclose([m["train/lr"] for m in train],
                               [1e-3 * (1 - (s - 1) / STEPS) for s in (6, 12, 18, 24)], rtol=1e-5)


@pytest.mark.slow
def test_reference_logps_are_the_initial_policys_and_saved_with_the_run(runs_both_ways):
    from pjit_ppo.data.prompts import load_tokenizer
    from pjit_ppo.dpo import pairs, reference
    from pjit_ppo.loading import load_lm
    config, out, workdir = runs_both_ways[True]
    saved = np.load(workdir / dpo.REFERENCE_FILE)
    train_records, test_records = pairs.split_labels(config)
    arrays = pairs.tokenized_pairs(test_records, load_tokenizer(config.tokenizer_path), config)
    mesh = sharding.make_mesh()
    cfg, initial = load_lm(config.model, "", mesh, config.seed)
    want = jax.jit(lambda p, b: dpo.pair_logps(cfg, p, b))(initial, arrays)
    np.testing.assert_allclose(saved["test/ref_chosen"], np.asarray(want[0]), rtol=1e-5)
    np.testing.assert_allclose(saved["test/ref_rejected"], np.asarray(want[1]), rtol=1e-5)
    assert saved["train/ref_chosen"].shape == (216,)
    assert reference.REF_KEYS == ("ref_chosen", "ref_rejected")
    assert not (runs_both_ways[False][2] / dpo.REFERENCE_FILE).exists()


@pytest.mark.slow
def test_per_batch_reference_gives_the_same_run(runs_both_ways):
    """Equal up to float rounding (the reference scores other batch shapes). The share of
    pairs ranked right may differ by a pair or two: in the first steps every margin is
    near 0, so rounding decides the sign of some."""
    a, b = _lines(runs_both_ways[True][2]), _lines(runs_both_ways[False][2])
    assert [m["iteration"] for m in a] == [m["iteration"] for m in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            if key.endswith("accuracies"):
                assert abs(x[key] - y[key]) <= 0.025, (key, x[key], y[key])
            elif not key.startswith("time/"):
                np.testing.assert_allclose(x[key], y[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_output_is_an_hf_directory_of_the_trained_policy(runs_both_ways):
    import transformers

    from pjit_ppo.models import load_pretrained
    config, out, workdir = runs_both_ways[True]
    assert out["model_dir"] == str(workdir / dpo.MODEL_DIR)
    tok = transformers.AutoTokenizer.from_pretrained(out["model_dir"])
    assert tok.pad_token_id == 1
    cfg, params = load_pretrained(out["model_dir"])
    assert cfg.vocab_size == tiny_text.VOCAB
    from pjit_ppo.loading import load_lm
    _, initial = load_lm(config.model, "", sharding.make_mesh(), config.seed)
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                         params, initial)
    assert max(jax.tree.leaves(moved)) > 1e-3  # trained, not the initial weights
