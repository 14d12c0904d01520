"""The PPO scoring passes (last layer and head on response positions only) against the
plain full forward: log-probs, values and the reward score at the last real token."""
import jax
import jax.numpy as jnp
import numpy as np

from pjit_ppo import padding
from pjit_ppo.models import heads, transformer
from pjit_ppo.models.config import ModelConfig
from pjit_ppo.models import scoring

CONFIG = ModelConfig.from_hf_dict(dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=2,
                                       n_head=4, n_positions=64))
BATCH, QUERY, RESPONSE, TEMPERATURE = 4, 7, 5, 0.7


def _inputs():
    k_q, k_r = jax.random.split(jax.random.PRNGKey(3))
    query = jax.random.randint(k_q, (BATCH, QUERY), 0, CONFIG.vocab_size)
    response = jax.random.randint(k_r, (BATCH, RESPONSE), 0, CONFIG.vocab_size)
    # left padding 0, 2, 6 tokens; row 3 is all padding (an empty query)
    query_mask = jnp.arange(QUERY)[None] >= jnp.array([[0], [2], [6], [QUERY]])
    # responses truncated to 5, 3, 0 and 0 real tokens
    response_mask = jnp.arange(RESPONSE)[None] < jnp.array([[5], [3], [0], [0]])
    return query, query_mask, response, response_mask


def _params():
    params = jax.jit(transformer.init_params, static_argnums=0)(CONFIG, jax.random.PRNGKey(1))
    value = {"value_head": {"w": jax.random.normal(jax.random.PRNGKey(5), (CONFIG.d_model,)),
                            "b": jnp.asarray(0.3)}}
    return {**params, **value, **heads.init_reward_head(CONFIG.d_model, jax.random.PRNGKey(6))}


def _full(params, query, query_mask, response, response_mask):
    ids = jnp.concatenate([query, response], axis=1)
    mask = jnp.concatenate([query_mask, response_mask], axis=1)
    hidden, logits, _ = transformer.forward(CONFIG, params, ids, mask)
    return hidden, logits, mask


def test_logprobs_and_values_match_the_full_forward():
    params = _params()
    query, query_mask, response, response_mask = _inputs()
    hidden, logits, _ = _full(params, query, query_mask, response, response_mask)
    at = slice(QUERY - 1, QUERY + RESPONSE - 1)
    logp_all = jax.nn.log_softmax(logits[:, at] / TEMPERATURE, axis=-1)
    want_logp = jnp.take_along_axis(logp_all, response[..., None], axis=-1)[..., 0]
    want_values = heads.value_from_hidden(params, hidden[:, at])

    got_logp = jax.jit(lambda p: scoring.response_logprobs(
        CONFIG, p, query, query_mask, response, TEMPERATURE, response_mask))(params)
    got_values = jax.jit(lambda p: scoring.response_values(
        CONFIG, p, query, query_mask, response, response_mask))(params)
    np.testing.assert_allclose(got_logp, want_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_values, want_values, atol=1e-5, rtol=1e-5)


def test_reward_is_scored_at_the_last_real_token():
    params = _params()
    query, query_mask, response, response_mask = _inputs()
    hidden, _, mask = _full(params, query, query_mask, response, response_mask)
    # last real token: response ends at Q+4 and Q+2; rows 2 and 3 have no response, so
    # row 2's is the last query token; row 3 has none and is scored at Q-1.
    last = np.array([QUERY + 4, QUERY + 2, QUERY - 1, QUERY - 1])
    np.testing.assert_array_equal(padding.last_true_index(mask)[:3], last[:3])
    want = heads.reward_from_hidden(params, hidden[jnp.arange(BATCH), last])

    got = jax.jit(lambda p: scoring.sequence_reward(
        CONFIG, p, query, query_mask, response, response_mask))(params)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert len(set(np.round(np.asarray(got), 4))) == BATCH  # rows really differ


# ---------------------------------------------------------------- the reward kinds
def _run_config(**reward):
    from pjit_ppo.config import ModelOptions, PPOConfig, RewardOptions, RunConfig
    return RunConfig(model=ModelOptions(random=dict(model_type="gpt2", vocab_size=64, n_embd=32,
                                                    n_layer=2, n_head=4, n_positions=64)),
                     ppo=PPOConfig(query_length=QUERY, response_length=RESPONSE,
                                   truncate_token=None, critic_init="policy"),
                     reward=RewardOptions(**reward))


def test_reward_kinds_build_their_reward():
    """Each kind through the registry: the target-token fraction; the reward model's
    score, frozen copy in the compute dtype, trunk for a critic and FLOPs."""
    from pjit_ppo import flops, param_makers, rewards, sharding
    mesh = sharding.make_mesh(1, -1, 1)
    query, query_mask, response, response_mask = _inputs()

    tokens = rewards.build(_run_config(kind="target_tokens", target_ids=(5, 6)),
                           param_makers.Loaded(mesh))
    assert tokens.params is None and tokens.trunk is None and tokens.flops == 0.0
    want = [np.mean(np.isin(np.asarray(row)[:n], (5, 6))) if n else 0.0
            for row, n in zip(response, (5, 3, 0, 0))]
    np.testing.assert_allclose(tokens.fn(None, query, query_mask, response, response_mask),
                               want, rtol=1e-6)

    config = _run_config(kind="model", head_seed=7)
    config.model.compute_dtype = "bfloat16"
    model = rewards.build(config, param_makers.Loaded(mesh))
    assert model.model.d_model == 32 and "lm_head" not in model.trunk
    assert {x.dtype for x in jax.tree.leaves(model.trunk)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
    head = heads.init_reward_head(32, jax.random.PRNGKey(7))["reward_head"]
    np.testing.assert_allclose(model.trunk["reward_head"]["w"], head["w"])
    got = model.fn(model.trunk, query, query_mask, response, response_mask)
    want = scoring.sequence_reward(model.model, model.trunk, query, query_mask, response,
                                   response_mask)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert model.flops == flops.forward_flops(model.model, QUERY + RESPONSE, QUERY + RESPONSE, 0,
                                              last_layer_tokens=RESPONSE + 1)
    assert rewards.describe(config).endswith("+ a random reward head (reward.head_seed=7)")


def test_reward_registry_and_config_checks_import_no_jax():
    """The config's reward check and the pre-flight's kind dispatch run before jax."""
    import subprocess
    import sys
    code = ("import sys; from pjit_ppo import preflight, rewards; "
            "from pjit_ppo.config import REWARD_KINDS, ModelOptions, RunConfig; "
            "c = RunConfig(model=ModelOptions(random={'x': 1})); c.ppo.critic_init = 'policy'; "
            "c.validate(); print(REWARD_KINDS == tuple(rewards.KINDS), 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "False"]
